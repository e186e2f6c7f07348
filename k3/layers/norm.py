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
            # nothing to cast: torch's rms_norm is the same formula, (x * rsqrt(mean(x^2) + eps)) * weight,
            # in one call instead of six
            h = F.rms_norm(x, self.weight.shape, self.weight, self.eps)
            return h if gate is None else cast(h * torch.sigmoid(upcast(gate)), x.dtype)
        h = upcast(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if gate is None:
            return self.weight * cast(h, x.dtype)
        return cast(upcast(self.weight) * h * torch.sigmoid(upcast(gate)), x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"

