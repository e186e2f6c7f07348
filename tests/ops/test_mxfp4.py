"""The MXFP4 codec (compressed-tensors' mxfp4-pack-quantized) and the expert that keeps its codes."""

from __future__ import annotations

import math

import pytest
import torch

from k3.layers.moe import Expert
from k3.layers.mxfp4_expert import MXFP4Expert
from k3.ops import mxfp4

MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def table_decode(byte: int, column: int, scale: int) -> float:
    """The issue's definition, one value at a time: low nibble = column 2j, high nibble = column 2j + 1."""
    code = byte & 0x0F if column % 2 == 0 else byte >> 4
    sign = -1.0 if code & 0x8 else 1.0
    return sign * math.ldexp(MAGNITUDES[code & 0x7], scale - 127)


def test_decoder_matches_the_table_on_every_byte():
    packed = torch.arange(256, dtype=torch.uint8).view(1, 256)  # 512 columns, 16 groups
    scale = torch.tensor(
        [[0, 1, 60, 100, 120, 126, 127, 128, 130, 140, 160, 200, 230, 240, 250, 252]], dtype=torch.uint8
    )
    decoded = mxfp4.decode(packed, scale)
    for column in range(512):
        byte, group = column // 2, column // 32
        assert decoded[0, column].item() == table_decode(byte, column, int(scale[0, group])), column


def test_representable_values_survive_unchanged():
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (3, 8, 64), generator=g, dtype=torch.uint8)  # leading dims pass through
    scale = torch.randint(100, 150, (3, 8, 4), generator=g, dtype=torch.uint8)
    values = mxfp4.decode(packed, scale)
    again = mxfp4.encode(values)
    assert torch.equal(mxfp4.decode(*again), values)
    # canonical codes (no -0, the scale from the group maximum) come back byte for byte
    assert all(torch.equal(a, b) for a, b in zip(mxfp4.encode(mxfp4.decode(*again)), again))
    assert torch.equal(mxfp4.decode(*again, dtype=torch.bfloat16).float(), values)  # exact in bf16 too


def test_random_weights_come_back_within_the_format_error():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * 0.02
    packed, scale = mxfp4.encode(w)
    assert packed.shape == (64, 128) and scale.shape == (64, 8) and packed.dtype == scale.dtype == torch.uint8
    error = (mxfp4.decode(packed, scale) - w).abs().unflatten(-1, (8, 32))
    step = mxfp4.scale_factors(scale).unsqueeze(-1)  # 1 unit of the scale: the widest gap (4 -> 6) is 2
    assert (error <= step).all()
    amax = w.abs().unflatten(-1, (8, 32)).amax(-1, keepdim=True)
    assert (step <= amax / 3.5).all()  # the scale follows the group's maximum (6 * scale >= ~1.7 amax)


def test_rounding_ties_to_even_and_zero_is_code_0():
    row = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.1, -0.25, -5.0] + [0.0] * 21)
    packed, scale = mxfp4.encode(row.view(1, 32))
    assert scale.item() == 127  # amax 6 = 1.5 x 4: the scale is 4 / 4 = 1
    assert mxfp4.decode(packed, scale)[0, :11].tolist() == [0, 1, 1, 2, 2, 4, 4, 6, 0, 0, -4]
    assert mxfp4.unpack_codes(packed)[0, 8].item() == 0  # a negative value that rounds to zero: code 0
    # from 1.75 x 2^e the maximum rounds up: amax 7 = 1.75 x 4 -> 8, scale 2, and 7 / 2 = 3.5 -> 4
    packed, scale = mxfp4.encode(torch.tensor([7.0, 6.9] + [0.0] * 30).view(1, 32))
    assert scale.item() == 128 and mxfp4.decode(packed, scale)[0, :2].tolist() == [8.0, 6.0]


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="`weight_packed` must be uint8"):
        mxfp4.decode(torch.zeros(2, 16), torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"`weight_scale` must be \[2, 1\]"):
        mxfp4.decode(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 32 columns"):
        mxfp4.encode(torch.zeros(2, 48))


def test_mxfp4_expert_runs_the_decoded_matrices():
    torch.manual_seed(0)
    expert = Expert(64, 96, "situ")
    kept = MXFP4Expert.from_expert(expert)
    assert list(kept.state_dict()) == [
        f"{m}.{p}" for m in ("w1", "w3", "w2") for p in ("weight_packed", "weight_scale")
    ]
    for name in ("w1", "w3", "w2"):
        with torch.no_grad():
            getattr(expert, name).copy_(mxfp4.decode(*mxfp4.encode(getattr(expert, name))))
    x = torch.randn(5, 64)
    torch.testing.assert_close(kept(x), expert(x))
    assert kept.nbytes() * 8 == 3 * 64 * 96 * 4.25
    kept = kept.to(torch.bfloat16)
    assert kept.w2.dtype == torch.bfloat16 and kept.w2_packed.dtype == torch.uint8
    with pytest.raises(ValueError, match="multiples of 32"):
        MXFP4Expert(48, 64)
