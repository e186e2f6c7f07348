"""The experts' grouped GEMM as one op that torch.compile sees whole (`k3::grouped_mm`).

With the rows of x [M, K] sorted by group and `offsets` [G] the end of each group's rows (int32, on the
device), group g's rows times its matrix w[g] of w [G, K, N]:

    y[o_{g-1} : o_g] = x[o_{g-1} : o_g] @ w[g]                                  y [M, N]

torch's `F.grouped_mm` computes it (one call for every expert, the offsets never read by the host). k3
registers it as a custom op with its own shape function, because the one torch 2.13 traces `grouped_mm`
with takes bfloat16 only, and its own backward, the same products:

    dx = grouped_mm(dy, w^T)          dw[g] = x_g^T dy_g   (`grouped_mm_weight`: [G, K, N])

Operands as `F.grouped_mm` wants them: float32, bfloat16 or float16, every row a multiple of 16 bytes
(`k3.layers.moe.grouped_mm_runs` checks). In float64, which torch's op refuses, the same products run
row by row against each row's gathered matrix (memory M K N: for the exactness tests, not for speed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TORCH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what F.grouped_mm takes


def group_of_rows(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows]: the group each row belongs to (rows past the last offset: group G, which the callers skip)."""
    return torch.searchsorted(offsets, torch.arange(rows, device=offsets.device, dtype=offsets.dtype), right=True)


@torch.library.custom_op("k3::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [M, K] (rows grouped by `offsets` [G]), w [G, K, N] -> [M, N]: each group's rows times its w[g]."""
    if x.dtype in TORCH_DTYPES:
        return F.grouped_mm(x, w, offs=offsets).contiguous()
    group = group_of_rows(offsets, x.shape[0])
    padded = torch.cat([w, w.new_zeros(1, *w.shape[1:])])  # rows past the groups: zeros, as torch's op leaves
    return torch.bmm(x.unsqueeze(1), padded.index_select(0, group)).squeeze(1)


@grouped_mm.register_fake
def _(x, w, offsets):
    return x.new_empty(x.shape[0], w.shape[-1])


@torch.library.custom_op("k3::grouped_mm_weight", mutates_args=())
def grouped_mm_weight(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [M, K], dy [M, N] (rows grouped by `offsets` [G]) -> [G, K, N]: x_g^T dy_g for each group g."""
    if x.dtype in TORCH_DTYPES:
        return F.grouped_mm(x.t(), dy.contiguous(), offs=offsets).contiguous()
    G, group = offsets.shape[0], group_of_rows(offsets, x.shape[0])
    outer = x.unsqueeze(2) * dy.unsqueeze(1)  # [M, K, N]
    return x.new_zeros(G + 1, x.shape[1], dy.shape[1]).index_add_(0, group, outer)[:G]


@grouped_mm_weight.register_fake
def _(x, dy, offsets):
    return x.new_empty(offsets.shape[0], x.shape[1], dy.shape[1])


def _save(ctx, inputs, output) -> None:
    x, w, offsets = inputs
    ctx.save_for_backward(x, w, offsets)


def _backward(ctx, dy):
    x, w, offsets = ctx.saved_tensors
    dx = grouped_mm(dy.contiguous(), w.transpose(1, 2), offsets) if ctx.needs_input_grad[0] else None
    dw = grouped_mm_weight(x, dy, offsets) if ctx.needs_input_grad[1] else None
    return dx, dw, None


grouped_mm.register_autograd(_backward, setup_context=_save)
