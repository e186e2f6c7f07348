"""RMSNorm: x / sqrt(mean(x^2) + eps) * weight, normalised in float32 (as Kimi Linear / DeepSeek do), and
optionally gated: the linear family's output norm multiplies each head's normalised output by
sigmoid(output gate)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.common import cast

WIDE = (torch.float32, torch.float64)  # the dtypes norms, gates and softmax run in


def upcast(x: torch.Tensor) -> torch.Tensor:
    """x in at least float32 (float64 stays float64): the precision norms, gates and softmax run in.
    A float32 or float64 x comes back as it is, without a call into torch (a decode step makes hundreds)."""
    return x if x.dtype in WIDE else x.float()


def inverse_rms(x: torch.Tensor, eps: float, keepdim: bool = False) -> torch.Tensor:
    """x [..., D] -> 1 / rms(x) = (mean(x^2) + eps)^-1/2 per row: [...] ([..., 1] with keepdim). The sum of
    squares as a norm (one reduction over x, no squared copy of it)."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=keepdim)
    return torch.rsqrt(norm.square().mul_(1 / x.shape[-1]).add_(eps))  # norm as it is: its backward reads it


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dimension (x and weight of one dtype): torch's
    rms_norm, with `_RMSNorm`'s backward when a gradient is wanted."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps)
    return F.rms_norm(x, weight.shape, weight, eps)


class _RMSNorm(torch.autograd.Function):
    """y = x^ w with x^ = x r, r = (mean(x^2) + eps)^-1/2 per row; saves x^ and r (x^ in place of x: the
    same memory, one pass fewer backward). With G = dL/dy:

        dL/dw = sum_rows G x^,      dL/dx = r (G w - x^ mean(G w x^))

    (on a CPU, autograd through torch's composite rms_norm takes about 1.6 times as long: 3.1 against
    1.9 ms forward + backward on [8, 256, 192])."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        r = inverse_rms(x, eps, keepdim=True)
        x_hat = x * r
        ctx.save_for_backward(x_hat, weight, r)
        return x_hat * weight

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x_hat, weight, r = ctx.saved_tensors
        grad_weight = (grad * x_hat).reshape(-1, x_hat.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        grad_x_hat = grad * weight
        grad_x = grad_x_hat.addcmul_(x_hat, (grad_x_hat * x_hat).mean(-1, keepdim=True), value=-1.0).mul_(r)
        return grad_x, grad_weight, None


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, with a learned per-channel `weight` (init 1).

    The statistics are taken in float32 whatever the input dtype. Without a gate the result is cast back
    to the input dtype before the weight is applied (the transformers Kimi Linear order); with one,
    `weight * norm(x) * sigmoid(gate)` is formed in float32 and then cast (fla's FusedRMSNormGated)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        if dim <= 0:
            raise ValueError(f"RMSNorm: `dim` must be positive, got {dim}")
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., dim] (and gate [..., dim] when given) -> [..., dim] in x's dtype."""
        if x.dtype in WIDE and self.weight.dtype == x.dtype:
            # nothing to cast: the formula, (x * rsqrt(mean(x^2) + eps)) * weight, in one call
            h = rms_norm(x, self.weight, self.eps)
            return h if gate is None else cast(h * torch.sigmoid(upcast(gate)), x.dtype)
        h = upcast(x)
        h = h * inverse_rms(h, self.eps, keepdim=True)
        if gate is None:
            return self.weight * cast(h, x.dtype)
        return cast(upcast(self.weight) * h * torch.sigmoid(upcast(gate)), x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
