"""MXFP4 as compressed-tensors stores it (`format: "mxfp4-pack-quantized"`): the codec of Kimi K3's
published routed experts.

A weight W [out, in] is cut along `in` into groups of 32 consecutive columns; each group shares one E8M0
scale (a bare exponent byte s, the factor 2^(s - 127)) and each value is a 4-bit E2M1 code:

    bit 3: the sign        bits 0-2: an index into the magnitudes [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    W[r, c] = ±magnitude(code[r, c]) * 2^(scale[r, c // 32] - 127)

On disk: `weight_packed` uint8 [out, in / 2], two codes a byte (the low nibble is column 2j, the high
nibble column 2j + 1), and `weight_scale` uint8 [out, in / 32]. Leading dimensions (stacked experts) pass
through both ways.

The encoder follows the compressed-tensors scheme: a group's scale is its absolute maximum rounded to a
power of two (rounded up from 1.75 x a power of two, down below), divided by 4 (the largest E2M1 power
of two); each value divided by the scale goes to the nearest magnitude (6 at most), ties to the even
code. Zero is always stored as code 0 (a tiny negative value that rounds to zero loses its sign).
"""

from __future__ import annotations

import torch

GROUP_SIZE = 32
MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# the midpoints between neighbouring magnitudes: a value on one goes to the even code of the two
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
BITS_PER_WEIGHT = 4 + 8 / GROUP_SIZE  # 4.25: a code per weight and a scale byte per group


def e2m1_values(device=None) -> torch.Tensor:
    """The 16 E2M1 codes' values [16] (float32): codes 0-7 positive, 8-15 their negatives (8 is -0)."""
    table = torch.tensor(MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([table, -table])


def scale_factors(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> 2^(s - 127) in float32, built from the bits (exact; s = 0 is the subnormal 2^-127,
    s = 255 reads as infinity)."""
    s = scale.to(torch.int32)
    bits = torch.where(s == 0, torch.full_like(s, 1 << 22), s << 23)
    return bits.view(torch.float32)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., in / 2] -> the E2M1 codes [..., in] (uint8, 0-15): low nibble first."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """The inverse of unpack_codes: codes [..., in] (0-15, `in` even) -> uint8 [..., in / 2]."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _check(name: str, t: torch.Tensor) -> None:
    if t.dtype != torch.uint8:
        raise ValueError(f"MXFP4: `{name}` must be uint8, got {t.dtype}")


def decode(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`weight_packed` [..., out, in / 2] and `weight_scale` [..., out, in / 32] (uint8) -> W [..., out, in]
    in `dtype` (exact in float32 and bfloat16, which share float32's exponent range: scales up to 252;
    beyond, 6 x 2^(s - 127) overflows to infinity)."""
    _check("weight_packed", packed)
    _check("weight_scale", scale)
    columns = packed.shape[-1] * 2
    if scale.shape[:-1] != packed.shape[:-1] or scale.shape[-1] * GROUP_SIZE != columns:
        raise ValueError(
            f"MXFP4: `weight_scale` must be {[*packed.shape[:-1], columns // GROUP_SIZE]} for "
            f"`weight_packed` {list(packed.shape)} (one scale per {GROUP_SIZE} columns), "
            f"got {list(scale.shape)}"
        )
    values = e2m1_values(packed.device)[unpack_codes(packed).long()]  # [..., out, in]
    groups = values.unflatten(-1, (-1, GROUP_SIZE)) * scale_factors(scale).unsqueeze(-1)
    return groups.flatten(-2).to(dtype)


def encode(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [..., out, in] (`in` a multiple of 32) -> (`weight_packed` [..., out, in / 2], `weight_scale`
    [..., out, in / 32]), both uint8, by the compressed-tensors rule (module docstring)."""
    if not weight.is_floating_point() or weight.shape[-1] % GROUP_SIZE:
        raise ValueError(
            f"MXFP4: the weight must be floating point with a multiple of {GROUP_SIZE} columns, "
            f"got {weight.dtype} {list(weight.shape)}"
        )
    groups = weight.detach().float().unflatten(-1, (-1, GROUP_SIZE))  # [..., out, in / 32, 32]
    amax = groups.abs().amax(-1)
    # round amax to a power of two (adding 2^21 to the bits carries into the exponent from 1.75 x 2^e
    # up), keep its exponent byte, and divide by 4 = 2^2: the scale byte is that exponent - 2
    exponent = ((amax.view(torch.int32) + (1 << 21)) >> 23) & 0xFF
    scale = (exponent - 2).clamp(0, 255)
    x = groups / scale_factors(scale).unsqueeze(-1)
    midpoints = torch.tensor(_MIDPOINTS, device=weight.device)
    down = torch.bucketize(x.abs(), midpoints, right=False)  # a tie goes to the smaller magnitude
    up = torch.bucketize(x.abs(), midpoints, right=True)  # a tie goes to the larger one
    index = torch.where((down != up) & (up % 2 == 0), up, down)
    codes = index | ((x < 0) & (index > 0)).to(index.dtype) << 3
    return pack_codes(codes.flatten(-2)), scale.to(torch.uint8)
