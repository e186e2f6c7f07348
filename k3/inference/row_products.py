"""A few rows times a matrix as a reduction, for a compiled decode step on the CPU.

Decoding one token multiplies one row (or a few) by every weight matrix: y = x W^T, a matrix-vector
product bound by reading W. A GEMM library call reads W at about half the speed the memory allows for one
row, and worse for two, on the 2-core CPUs k3 is measured on; written as the broadcast product summed,

    y[r, o] = sum_i x[r, i] W[o, i]          (x [R, in], W [out, in], R <= ROWS)

inductor emits one C++ reduction kernel that streams W once, vectorized, with no product stored, and
fuses a gather in front of it (the MoE's chosen experts read straight from the stack: no copy of them).

`RowProducts` is a torch function mode for the compiled step: inside it `F.linear` (every `nn.Linear`) and
`torch.bmm` with at most `ROWS` rows per matrix run as those reductions; larger ones, and everything
else, as they are. Eagerly the product would be stored whole, so the decode step enters it only when it
compiles for the CPU (`DecodeStep`). The sums run in another order than the GEMM's: equal to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

ROWS = 4  # rows per matrix up to which the reduction is used (2 rows: 3x a GEMM call; 8: even)


class RowProducts(TorchFunctionMode):
    """`F.linear(x, W, b)` and `torch.bmm(a, b)` with few rows as reductions (module docstring)."""

    def __init__(self, rows: int = ROWS):
        super().__init__()
        self.rows = rows

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if x.dim() >= 1 and x.numel() <= self.rows * x.shape[-1]:
                return linear_rows(x, weight, bias)
        elif func is torch.bmm and not kwargs:
            a, b = args
            if a.shape[1] <= self.rows:
                return bmm_rows(a, b)
        return func(*args, **kwargs)


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) as sum_i x[..., None, i] weight[:, i] (+ bias)."""
    y = (x.unsqueeze(-2) * weight).sum(-1)
    return y if bias is None else y + bias


def bmm_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.bmm(a [n, R, k], b [n, k, m]) as sum_k a[n, R, k, None] b[n, None, k, m]."""
    return (a.unsqueeze(-1) * b.unsqueeze(1)).sum(-2)
