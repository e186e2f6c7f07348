"""Block Attention Residuals (Kimi K3): each sub-layer reads a learned, token-wise mix of depth sources.

Instead of the plain residual sum, the input of a sub-layer is

    h = sum_n softmax_n( w . RMS(V_n) ) V_n,        w = norm.weight * proj.weight   (learned query)

over the sources V_n = [embedding, completed block sums ..., the current block's partial sum], where a
block sum is the element-wise sum of the attention and FFN outputs of B consecutive decoder layers
(B = 12 in K3). RMS has no weight of its own (the learned norm weight is folded into the query); V is
used un-normalised; everything runs in float32. proj starts at zero, so the first mix is uniform.
Token-local: nothing to cache across decoding steps. Which sources exist when is the decoder's
business (`k3.models.model.Decoder`).
"""

from __future__ import annotations

import torch
from torch import nn

from .norm import upcast


class BlockAttnRes(nn.Module):
    """One learned depth query (norm.weight * proj.weight) mixing a list of sources [..., D]."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.norm = nn.Module()  # holds only `weight`: the checkpoints' name for the query's scale
        self.norm.weight = nn.Parameter(torch.empty(dim))
        self.proj = nn.Linear(dim, 1, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The query starts at zero (proj = 0, norm = 1): every source gets the same weight."""
        nn.init.ones_(self.norm.weight)
        nn.init.zeros_(self.proj.weight)

    def weights(self, sources: list[torch.Tensor]) -> torch.Tensor:
        """The softmax weights [N, ...] (float32) this mix gives its N sources [..., D]."""
        return self._weights([upcast(v) for v in self._check(sources)])

    def _weights(self, values: list[torch.Tensor]) -> torch.Tensor:
        query = upcast(self.norm.weight) * upcast(self.proj.weight).squeeze(0)  # [D]
        # w . RMS(V_n) = (V_n . w) / rms(V_n): one [..] logit per source, no normalised copy of V
        logits = torch.stack([(v @ query) * torch.rsqrt(v.pow(2).mean(-1) + self.eps) for v in values])
        return torch.softmax(logits, dim=0)  # [N, ...]

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        """sources: N tensors [..., D] (same shape) -> the mix [..., D] in the sources' dtype."""
        values = [upcast(v) for v in self._check(sources)]
        alpha = self._weights(values)
        mix = values[0] * alpha[0].unsqueeze(-1)
        for a, v in zip(alpha[1:], values[1:]):
            mix = torch.addcmul(mix, v, a.unsqueeze(-1))
        return mix.to(sources[0].dtype)

    @staticmethod
    def _check(sources: list[torch.Tensor]) -> list[torch.Tensor]:
        if not sources:
            raise ValueError("BlockAttnRes: `sources` must hold at least one tensor, got none")
        return sources
