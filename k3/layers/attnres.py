"""Block Attention Residuals (Kimi K3): each sub-layer reads a learned, token-wise mix of depth sources.

Instead of the plain residual sum, the input of a sub-layer is

    h = sum_n softmax_n( w . RMS(V_n) ) V_n,        w = norm.weight * proj.weight   (learned query)

over the sources V_n = [embedding, completed block sums ..., the current block's partial sum], where a
block sum is the element-wise sum of the attention and FFN outputs of B consecutive decoder layers
(B = 12 in K3). RMS has no weight of its own (the learned norm weight is folded into the query); V is
used un-normalised; everything runs in float32. proj starts at zero, so the first mix is uniform.
Token-local: nothing to cache across decoding steps. Which sources exist when is the decoder's
business (`k3.models.model.Decoder`). A static decode step keeps them in one preallocated buffer
(`DepthSources`), so that each mix reads a slice of it instead of stacking its sources anew.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.common import cast
from .norm import inverse_rms, upcast

STACK_LIMIT = 1 << 16  # values per source up to which the sources are stacked and mixed in a few batched ops


class BlockAttnRes(nn.Module):
    """One learned depth query (norm.weight * proj.weight) mixing a list of sources [..., D].

    Two equal ways to compute the mix. Small sources (decoding: a token or a few, up to STACK_LIMIT
    values each) are stacked into one [N, ..., D] tensor, so that logits, softmax and the weighted sum
    are a handful of batched ops whatever N is. Large ones (training, prefill) are read one at a time,
    which costs a few ops per source but never a stacked copy of all of them."""

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
        query = self._query()
        return torch.softmax(torch.stack([self._logits(upcast(v), query) for v in self._check(sources)]), dim=0)

    def _query(self) -> torch.Tensor:
        """w = norm.weight * proj.weight [D], float32."""
        return upcast(self.norm.weight) * upcast(self.proj.weight).squeeze(0)

    def _logits(self, v: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        """v [..., D] (one source, or N stacked) -> w . RMS(v) [...] = (v . w) / rms(v): no normalised copy of v."""
        return (v @ query) * inverse_rms(v, self.eps)

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        """sources: N tensors [..., D] (same shape) -> the mix [..., D] in the sources' dtype."""
        values = [upcast(v) for v in self._check(sources)]
        if values[0].numel() <= STACK_LIMIT:
            mix = self._mix_stacked(torch.stack(values))
        else:
            mix = self._mix_each(values)
        return cast(mix, sources[0].dtype)

    def _mix_stacked(self, V: torch.Tensor) -> torch.Tensor:
        """V [N, ..., D] -> sum_n alpha_n V_n with alpha = softmax_n(logits), in one pass over the stack;
        the logits as RMSNorm(V) . w (torch's fused rms_norm: the stack is small, its normalised copy too)."""
        alpha = torch.softmax(F.rms_norm(V, V.shape[-1:], eps=self.eps) @ self._query(), dim=0)  # [N, ...]
        return (alpha.unsqueeze(-1) * V).sum(0)

    def _mix_each(self, values: list[torch.Tensor]) -> torch.Tensor:
        """The same mix from the list, one source at a time (no stacked copy of the sources), as one
        autograd function (`_DepthMix`)."""
        return _DepthMix.apply(self._query(), self.eps, *values)

    @staticmethod
    def _check(sources: list[torch.Tensor]) -> list[torch.Tensor]:
        if not sources:
            raise ValueError("BlockAttnRes: `sources` must hold at least one tensor, got none")
        return sources


class DepthSources:
    """A decode step's Block AttnRes sources in one buffer [n, B, T, D] (float32, allocated once by the
    static cache): `add` writes a completed source into the next slot; `read(mix, x)` writes the current
    partial sum x after them and mixes the slice (`BlockAttnRes._mix_stacked`), so no mix stacks its
    sources again. `count` is the slots filled: the same at the same layer of every step."""

    def __init__(self, buffer: torch.Tensor):
        self.buffer, self.count = buffer, 0
        self.dtype = buffer.dtype

    def add(self, x: torch.Tensor) -> None:
        if self.count == 0:
            self.dtype = x.dtype  # the mixes come out in the embedding's dtype, as BlockAttnRes's do
        self.buffer[self.count].copy_(x)
        self.count += 1

    def read(self, mix: BlockAttnRes, x: torch.Tensor | None) -> torch.Tensor:
        """The mix of the completed sources and x (None: the completed ones only)."""
        n = self.count
        if x is not None:
            self.buffer[n].copy_(x)
            n += 1
        return cast(mix._mix_stacked(self.buffer[:n]), self.dtype)


class _DepthMix(torch.autograd.Function):
    """mix = sum_n alpha_n V_n, alpha = softmax_n(l), l_n = (V_n . w) r_n, r_n = (mean(V_n^2) + eps)^-1/2,
    for sources V_n [..., D] and the query w [D], one source at a time. Backward, with G = dL/dmix:

        a_n = G . V_n,   e_n = alpha_n (a_n - sum_m alpha_m a_m)          (dL/dl_n)
        dV_n = alpha_n G + e_n r_n w - e_n (V_n . w) r_n^3 / D  V_n,   dw = sum_n sum_tokens e_n r_n V_n

    Besides the query it saves only the small per-token alpha, r and V_n . w (the sources are the model's
    own activations, held anyway): autograd through the formula would keep a few [..., D] intermediates
    per source and run a dozen ops per source backward."""

    @staticmethod
    def forward(ctx, query: torch.Tensor, eps: float, *values: torch.Tensor) -> torch.Tensor:
        r = torch.stack([inverse_rms(v, eps) for v in values])  # [N, ...]
        dots = torch.stack([v @ query for v in values])  # V_n . w
        alpha = torch.softmax(dots * r, dim=0)
        mix = values[0] * alpha[0].unsqueeze(-1)
        for a, v in zip(alpha[1:], values[1:]):
            mix = torch.addcmul(mix, v, a.unsqueeze(-1))
        ctx.save_for_backward(query, alpha, r, dots, *values)
        return mix

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        query, alpha, r, dots, *values = ctx.saved_tensors
        D = query.shape[0]
        a = torch.stack([torch.linalg.vecdot(grad, v) for v in values])  # [N, ...]
        e = alpha * (a - (alpha * a).sum(0, keepdim=True))
        er = e * r
        shrink = er * dots * r.square() * (1.0 / D)  # the rms's share of dL/dV_n, per token
        grads = []
        for alpha_n, er_n, shrink_n, v in zip(alpha, er, shrink, values):
            g = (grad * alpha_n.unsqueeze(-1)).addcmul_(er_n.unsqueeze(-1), query)
            grads.append(g.addcmul_(shrink_n.unsqueeze(-1), v, value=-1.0))
        grad_query = sum(er_n.reshape(-1) @ v.reshape(-1, D) for er_n, v in zip(er, values))
        return (grad_query, None, *grads)
