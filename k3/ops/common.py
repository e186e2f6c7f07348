"""Argument checking and layout helpers shared by every sequence mixer in `k3.ops`.

Every op takes `[B, T, H, K]` inputs (docs/design.md: tensor conventions). The helpers here validate them once, pick the
accumulation dtype (float32, or float64 for float64 inputs), and turn packed variable-length input
(`cu_seqlens`, B = 1) into a padded batch `[N, T_max, ...]` and back. Padding is *neutral*: k = v = 0,
beta = 0 and g = 0, so a padded step leaves the recurrent state exactly as it was.

Non-finite inputs. The chunkwise forms mix the rows of a chunk in matmuls and triangular solves, where a
zero coefficient times a NaN or inf of a *later* row is NaN: without care, a bad value at position p
would reach the outputs before p, which the recurrence never lets happen. `nonfinite_onwards` finds the
positions at and after the first bad value (one sum per input and one read-back when all are finite);
a chunk form then runs once more with neutral steps there (`zero_onwards`) and takes the outputs before
p from that run (`keep_causal`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch


def _fail(op: str, arg: str, expected: str, actual) -> ValueError:
    return ValueError(f"{op}: `{arg}` must be {expected}, got {actual}")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 for float64 inputs, float32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`: x itself when it already is. `x.to(dtype)` would return x too, but only after a trip
    through the dispatcher, which a decode step pays for on every tensor it touches."""
    return x if x.dtype == dtype else x.to(dtype)


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast runs matmuls in on x's device (bfloat16 under `k3 train --precision bf16`), or
    None when autocast is off there."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def without_autocast(x: torch.Tensor):
    """A context in which autocast is off on x's device: the delta family's recurrences keep their
    states and matmuls in the accumulation dtype whatever precision the model around them trains in."""
    return torch.autocast(x.device.type, enabled=False)


def check_tensor(op: str, name: str, x, shape: tuple, ref: torch.Tensor, also: torch.dtype | None = None) -> None:
    """Check that `x` is a tensor of `shape` (None = any size) with `ref`'s dtype (or `also`) and device."""
    if not isinstance(x, torch.Tensor):
        raise _fail(op, name, "a torch.Tensor", type(x).__name__)
    if x.dim() != len(shape) or any(s is not None and s != a for s, a in zip(shape, x.shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise _fail(op, name, f"of shape {want}", list(x.shape))
    if x.dtype != ref.dtype and x.dtype != also:
        alternative = "" if also is None or also == ref.dtype else f" or {also}"
        raise _fail(op, name, f"of dtype {ref.dtype} (the dtype of q){alternative}", x.dtype)
    if x.device != ref.device:
        raise _fail(op, name, f"on device {ref.device} (the device of q)", x.device)


def check_qkv(op: str, q, k, v) -> tuple[int, int, int, int, int]:
    """Validate q, k `[B, T, H, K]` and v `[B, T, H, V]`; return (B, T, H, K, V)."""
    if not isinstance(q, torch.Tensor):
        raise _fail(op, "q", "a torch.Tensor", type(q).__name__)
    if q.dim() != 4:
        raise _fail(op, "q", "4-D [B, T, H, K]", f"shape {list(q.shape)}")
    if not q.is_floating_point():
        raise _fail(op, "q", "a floating-point tensor", q.dtype)
    B, T, H, K = q.shape
    check_tensor(op, "k", k, (B, T, H, K), q)
    check_tensor(op, "v", v, (B, T, H, None), q)
    return B, T, H, K, v.shape[-1]


def check_cu_seqlens(op: str, cu_seqlens, B: int, T: int, device) -> torch.Tensor | None:
    """Validate packed-sequence offsets `[N+1]`: B = 1, 0 = c_0 < c_1 < ... < c_N = T."""
    if cu_seqlens is None:
        return None
    if not isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = torch.as_tensor(cu_seqlens)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise _fail(
            op,
            "cu_seqlens",
            "a 1-D integer tensor [N+1] with N >= 1",
            f"dtype {cu_seqlens.dtype}, shape {list(cu_seqlens.shape)}",
        )
    if B != 1:
        raise _fail(op, "cu_seqlens", "used with batch size B = 1 (sequences packed along T)", f"B = {B}")
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0 or offsets[-1] != T:
        raise _fail(op, "cu_seqlens", f"offsets starting at 0 and ending at T = {T}", f"{offsets[0]} ... {offsets[-1]}")
    if any(b <= a for a, b in zip(offsets, offsets[1:])):
        raise _fail(op, "cu_seqlens", "strictly increasing (every sequence non-empty)", offsets)
    return cu_seqlens.to(device=device, dtype=torch.long)


def check_chunk_size(op: str, chunk_size) -> int:
    """chunk_size must be a positive int (any T works with any chunk size)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise _fail(op, "chunk_size", "a positive int", repr(chunk_size))
    return chunk_size


def check_state(op: str, name: str, state, shape: tuple, ref: torch.Tensor) -> torch.Tensor | None:
    """Validate an initial state of `shape`; any floating dtype, cast to the accumulation dtype."""
    if state is None:
        return None
    if not isinstance(state, torch.Tensor):
        raise _fail(op, name, "a torch.Tensor", type(state).__name__)
    if tuple(state.shape) != tuple(shape):
        layout = "[N, H, K, V]" if len(shape) == 4 else "[N, H, K]"
        raise _fail(
            op, name, f"of shape {list(shape)} {layout} (N = batch size or packed sequences)", list(state.shape)
        )
    if not state.is_floating_point():
        raise _fail(op, name, "a floating-point tensor", state.dtype)
    if state.device != ref.device:
        raise _fail(op, name, f"on device {ref.device} (the device of q)", state.device)
    return cast(state, compute_dtype(ref.dtype))


def check_log_decay(op: str, g: torch.Tensor, lower_bound: float | None = None) -> None:
    """g is a log decay: every entry must be <= 0 (exp(g) in [0, 1]); -inf clears the state. With
    `lower_bound`, every entry must also be >= it."""
    if g.numel() == 0:
        return
    largest = g.max()  # NaN if any entry is NaN
    if not bool(largest <= 0):
        bad = g[(g > 0) | torch.isnan(g)]
        raise _fail(
            op,
            "g",
            "a log decay with every entry <= 0 (alpha = exp(g) in [0, 1])",
            f"{bad.numel()} entries > 0 or NaN, e.g. {bad.flatten()[0].item()}",
        )
    if lower_bound is not None and not bool(g.min() >= lower_bound):
        bad = g[g < lower_bound]
        raise _fail(
            op,
            "g",
            f"every entry >= lower_bound = {lower_bound}",
            f"{bad.numel()} entries below it, e.g. {bad.flatten()[0].item()}",
        )


def check_lower_bound(op: str, lower_bound) -> float:
    """A stated lower bound on every step's log decay: a finite Python float < 0."""
    if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)):
        raise _fail(op, "lower_bound", "None or a Python float < 0", type(lower_bound).__name__)
    if not (math.isfinite(lower_bound) and lower_bound < 0):
        raise _fail(op, "lower_bound", "None or a finite float < 0", repr(lower_bound))
    return float(lower_bound)


def check_scale(op: str, scale, K: int) -> float:
    """scale multiplies q; None means K^-1/2. A finite Python number (NaN or an infinity would fill every
    output with NaN)."""
    if scale is None:
        return K**-0.5
    if isinstance(scale, (torch.Tensor, bool)) or not isinstance(scale, (int, float)):
        raise _fail(op, "scale", "a Python float or None", type(scale).__name__)
    if not math.isfinite(scale):
        raise _fail(op, "scale", "a finite float or None", repr(scale))
    return float(scale)


def check_eps(op: str, eps) -> float:
    """eps, added to a denominator: a finite Python number >= 0 (NaN fills every output with NaN; a
    negative one can make the denominator zero)."""
    if isinstance(eps, (torch.Tensor, bool)) or not isinstance(eps, (int, float)):
        raise _fail(op, "eps", "a Python float >= 0", type(eps).__name__)
    if not (math.isfinite(eps) and eps >= 0):
        raise _fail(op, "eps", "a finite float >= 0", repr(eps))
    return float(eps)


def inference_unless_grad(*tensors: torch.Tensor | None):
    """`torch.inference_mode()` when no gradient can flow through `tensors`, else a no-op context.

    The mixers' loops issue hundreds of small ops, each of which would otherwise pay for autograd
    bookkeeping (view tracking, version counters) that no backward pass will use.
    Tensors made inside are inference tensors: results handed back to the caller must be created
    outside the context (write into a tensor allocated before it, or copy out after it)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return contextlib.nullcontext()
    return torch.inference_mode()


def nonfinite_onwards(*xs: torch.Tensor | None) -> torch.Tensor | None:
    """[N, T, H] bool: the positions at and after the first NaN or inf in any of xs ([N, T, H, ...] each;
    None entries skipped) in their sequence and head. None when every value is finite: the common case
    costs one sum per tensor and one read-back (a finite sum that overflows only takes the slow path).
    Always None while torch.compile traces (`--compile` training), where the read-back would break the
    graph and a non-finite loss ends the run anyway."""
    xs = [x.detach() for x in xs if x is not None]  # a check, not part of the graph
    if not xs or torch.compiler.is_compiling() or bool(torch.isfinite(sum(x.sum() for x in xs))):
        return None
    bad = None
    for x in xs:
        flags = ~torch.isfinite(x)
        flags = flags.flatten(3).any(-1) if x.dim() > 3 else flags
        bad = flags if bad is None else bad | flags
    onwards = bad.cumsum(dim=1) > 0
    return onwards if bool(onwards.any()) else None


def zero_onwards(onwards: torch.Tensor, x: torch.Tensor | None) -> torch.Tensor | None:
    """x [N, T, H, ...] with 0 (a neutral step: k = v = beta = g = 0) where onwards [N, T, H] is set."""
    if x is None:
        return None
    return torch.where(onwards.view(*onwards.shape, *([1] * (x.dim() - 3))), 0.0, x)


def keep_causal(o: torch.Tensor, onwards: torch.Tensor | None, rerun) -> torch.Tensor:
    """o [N, T, H, V] of a chunk form, with the outputs before the first non-finite input (`onwards`, from
    `nonfinite_onwards`) taken from `rerun(zero)`, the same form run on inputs passed through `zero`
    (`zero_onwards` with those positions), so that no later value reaches them. o as it is when all
    inputs were finite."""
    if onwards is None:
        return o
    before = rerun(lambda x: zero_onwards(onwards, x))
    return torch.where(onwards.unsqueeze(-1), o, before)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the delta family's key/query normalization); with a
    gradient to take, `_L2Norm`'s."""
    if eps != 1e-6:  # the default needs no check (the layers' hot path)
        eps = check_eps("l2norm", eps)
    if torch.is_grad_enabled() and x.requires_grad and not torch.compiler.is_compiling():
        return _L2Norm.apply(x, eps)
    return x * _inverse_norm(x, eps)


def _inverse_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """(sum(x^2) + eps)^-1/2 over the last dim, kept as a size-1 dim."""
    return torch.rsqrt(x.pow(2).sum(-1, keepdim=True).add_(eps))


class _L2Norm(torch.autograd.Function):
    """y = x r, r = (sum(x^2) + eps)^-1/2 per row, saving y and r; backward dL/dx = r (G - y sum(G y))
    (half the passes of autograd through the formula)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, eps: float) -> torch.Tensor:
        r = _inverse_norm(x, eps)
        y = x * r
        ctx.save_for_backward(y, r)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        y, r = ctx.saved_tensors
        return torch.addcmul(grad, y, (grad * y).sum(-1, keepdim=True), value=-1.0).mul_(r), None


@dataclass
class Packing:
    """Where each token of a packed `[1, T, ...]` input lives in the padded `[N, T_max, ...]` batch."""

    cu_seqlens: torch.Tensor
    seq: torch.Tensor  # [T] sequence index of each token
    pos: torch.Tensor  # [T] position of each token inside its sequence
    max_len: int

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor) -> "Packing":
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        seq = torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths)
        pos = torch.arange(int(cu_seqlens[-1]), device=cu_seqlens.device) - cu_seqlens[seq]
        return cls(cu_seqlens, seq, pos, int(lengths.max()))

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[1, T, *rest] -> [N, T_max, *rest], zero-filled after each sequence's end."""
        out = x.new_zeros(self.num_seqs, self.max_len, *x.shape[2:])
        out[self.seq, self.pos] = x[0]
        return out

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """[N, T_max, *rest] -> [1, T, *rest]."""
        return y[self.seq, self.pos].unsqueeze(0)


def run_packed(fn, cu_seqlens: torch.Tensor | None, *seq_tensors: torch.Tensor | None):
    """Run `fn(*padded) -> (o, state)` on a padded batch if `cu_seqlens` is given, else directly.

    Every tensor in `seq_tensors` is `[B, T, ...]` (None passes through); `o` comes back `[B, T, ...]`.
    Padding is zeros, which `fn` must treat as a no-op step (see the module docstring).
    """
    if cu_seqlens is None:
        return fn(*seq_tensors)
    packing = Packing.from_cu_seqlens(cu_seqlens)
    o, state = fn(*(None if x is None else packing.pad(x) for x in seq_tensors))
    return packing.unpad(o), state


def to_chunks(x: torch.Tensor, C: int) -> torch.Tensor:
    """[N, T, H, d] with T = n*C  ->  [n, N*H, C, d] (chunk-major, so chunk i is one contiguous block)."""
    N, T, H, d = x.shape
    return x.reshape(N, T // C, C, H, d).permute(1, 0, 3, 2, 4).reshape(T // C, N * H, C, d)


def from_chunks(x: torch.Tensor, N: int, H: int) -> torch.Tensor:
    """[n, N*H, C, d]  ->  [N, n*C, H, d]."""
    n, _, C, d = x.shape
    return x.reshape(n, N, H, C, d).permute(1, 0, 3, 2, 4).reshape(N, n * C, H, d)
