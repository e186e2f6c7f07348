"""The experts' grouped GEMM as one op that torch.compile sees whole (`k3::grouped_mm`).

With the rows of x [M, K] sorted by group and `offsets` [G] the end of each group's rows (int32, on the
device), group g's rows times its matrix w[g] of w [G, K, N]:

    y[o_{g-1} : o_g] = x[o_{g-1} : o_g] @ w[g]                                  y [M, N]

torch's `F.grouped_mm` computes it (one call for every expert, the offsets never read by the host). k3
registers it as a custom op with its own shape function, because the one torch 2.13 traces `grouped_mm`
with takes bfloat16 only, and its own backward, the same products:

    dx = grouped_mm(dy, w^T)          dw[g] = x_g^T dy_g   (`grouped_mm_weight`: [G, K, N])

Operands as `F.grouped_mm` wants them: float32, bfloat16 or float16, every row a multiple of 16 bytes
(`k3.layers.moe.grouped_mm_runs` checks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.library.custom_op("k3::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [M, K] (rows grouped by `offsets` [G]), w [G, K, N] -> [M, N]: each group's rows times its w[g]."""
    return F.grouped_mm(x, w, offs=offsets).contiguous()


@grouped_mm.register_fake
def _(x, w, offsets):
    return x.new_empty(x.shape[0], w.shape[-1])


@torch.library.custom_op("k3::grouped_mm_weight", mutates_args=())
def grouped_mm_weight(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [M, K], dy [M, N] (rows grouped by `offsets` [G]) -> [G, K, N]: x_g^T dy_g for each group g."""
    return F.grouped_mm(x.t(), dy.contiguous(), offs=offsets).contiguous()


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
