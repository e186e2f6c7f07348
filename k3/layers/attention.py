"""GPT-2's causal multi-head attention: fused c_attn (with bias), softmax attention, c_proj (with bias).

    [q | k | v] = c_attn(x);  o = softmax(q k^T / sqrt(D), causal) v per head;  y = c_proj(o)

The KV cache grows by 2 * H * D values per token per layer: the O(T) memory the linear family avoids.
The cache (`k3.inference.cache`, made by `k3.models.kinds`) keeps them head-major, [B, H, N, D] (gpt-fast's
and transformers' layout), so attention's [B, H, N, D] operands are its buffers as they are; a decode step
writes one slot per row.

In a training step with QK-Clip on, each head's largest logit q . k / sqrt(D) is recorded as well
(`max_logits` [H], k3.layers.max_logit; nothing at inference): k3.training.qk_clip bounds it.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops import attention
from ..ops.attention import causal_attention
from .checks import check_mixer_input
from .init import init_linear
from .max_logit import record_max_logits


class MultiHeadAttention(nn.Module):
    """Causal multi-head softmax attention with GPT-2's parameter names (c_attn, c_proj)."""

    record_max_logits = False  # set by k3.training.qk_clip for its training steps
    max_logits: torch.Tensor | None = None  # [H]: the largest logit of each head since it was cleared

    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(
                f"MultiHeadAttention: `hidden_size` ({hidden_size}) must be divisible by `num_heads` ({num_heads})"
            )
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.c_attn = nn.Linear(hidden_size, 3 * hidden_size)
        self.c_proj = nn.Linear(hidden_size, hidden_size)
        self.reset_parameters()

    def reset_parameters(self, std: float | None = None, residual_std: float | None = None) -> None:
        """See k3.layers.init: c_attn ~ N(0, std), the output c_proj ~ N(0, residual_std), biases 0."""
        init_linear(self.c_attn, std)
        init_linear(self.c_proj, std if residual_std is None else residual_std)

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        """x [B, T, hidden_size] -> y; with `cache`, attend over the cached keys/values and append."""
        check_mixer_input("MultiHeadAttention", x, self.hidden_size, cache)
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).view(B, T, 3, self.num_heads, -1).unbind(2)  # [B, T, H, D] each
        if cache is None:
            record_max_logits(self, q, k, q.shape[-1] ** -0.5)  # (a training step's, for QK-Clip)
            o, _ = attention(q, k, v, check_values=False)
        else:  # the cache's rows and this call's, then the last T positions attend over them
            k_all, v_all = cache.append(k=k, v=v)
            mask = cache.visible(T, k_all.shape[1], x.device)
            record_max_logits(self, q, k_all, q.shape[-1] ** -0.5)
            o = causal_attention(q, k_all, v_all, scale=q.shape[-1] ** -0.5, mask=mask)
        return self.c_proj(o.reshape(B, T, self.hidden_size))
