"""Block Attention Residuals (Kimi K3): each sub-layer reads a learned, token-wise mix of depth sources.

Instead of the plain residual sum, the input of a sub-layer is

    h = sum_n softmax_n( w . RMS(V_n) ) V_n,        w = norm.weight * proj.weight   (learned query)

over the sources V_n = [embedding, completed block sums ..., the current block's partial sum], where a
block sum is the element-wise sum of the attention and FFN outputs of B consecutive decoder layers
(B = 12 in K3). RMS has no weight of its own (the learned norm weight is folded into the query); V is
used un-normalised; everything runs in float32. proj starts at zero, so the first mix is uniform.
Token-local: nothing to cache across decoding steps.
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
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(dim))
        self.proj = nn.Linear(dim, 1, bias=False)
        nn.init.zeros_(self.proj.weight)
        self.proj.weight._no_weight_decay = True
        self.norm.weight._no_weight_decay = True

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        """sources: N tensors [..., D] (same shape) -> the mix [..., D] in the sources' dtype."""
        if not sources:
            raise ValueError("BlockAttnRes: `sources` must hold at least one tensor, got none")
        query = upcast(self.norm.weight) * upcast(self.proj.weight).squeeze(0)  # [D]
        # w . RMS(V_n) = (V_n . w) / rms(V_n): one [..] logit per source, no normalised copy of V
        values = [upcast(v) for v in sources]
        logits = torch.stack([(v @ query) * torch.rsqrt(v.pow(2).mean(-1) + self.eps) for v in values])
        alpha = torch.softmax(logits, dim=0)  # [N, ...]
        mix = values[0] * alpha[0].unsqueeze(-1)
        for a, v in zip(alpha[1:], values[1:]):
            mix = torch.addcmul(mix, v, a.unsqueeze(-1))
        return mix.to(sources[0].dtype)
