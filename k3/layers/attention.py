"""GPT-2's causal multi-head attention: fused c_attn (with bias), softmax attention, c_proj (with bias).

    [q | k | v] = c_attn(x);  o = softmax(q k^T / sqrt(D), causal) v per head;  y = c_proj(o)

The KV cache grows by 2 * H * D values per token per layer: the O(T) memory the linear family avoids.
It keeps them in buffers with spare room (`k3.layers.cache.SequenceCache`), so a decode step writes one
row rather than copying the cache.

In a training step with QK-Clip on, each head's largest logit q . k / sqrt(D) is recorded as well
(`max_logits` [H], k3.layers.max_logit; nothing at inference): k3.training.qk_clip bounds it.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops import attention
from ..ops.attention import causal_attention
from .cache import SequenceCache, SequenceField, StaticSequenceCache
from .checks import check_mixer_input
from .init import init_linear
from .max_logit import record_max_logits


class KVCache(SequenceCache):
    """Keys and values seen so far, [B, S, H, D] each (`KVCache(k=..., v=...)` starts from given ones)."""

    k = SequenceField()
    v = SequenceField()

    tensor_fields = sequence_fields = ("k", "v")


class StaticKVCache(StaticSequenceCache):
    """Keys and values in buffers of N slots, written in place at the rows' positions
    (`k3.layers.cache.StaticSequenceCache`). Stored head-major, [B, H, N, D] (gpt-fast's and transformers'
    layout); `k` and `v` are their [B, N, H, D] views, so attention's [B, H, N, D] operands are the buffers
    themselves, which a compiled step reads as they are instead of copying them to that layout."""

    tensor_fields = sequence_fields = ("k", "v")

    def __init__(self, owner, k: torch.Tensor, v: torch.Tensor):
        """k, v: the [B, H, N, D] buffers."""
        self.owner, self._heads_first = owner, (k, v)

    def buffers(self) -> list[torch.Tensor]:
        return list(self._heads_first)

    @property
    def k(self) -> torch.Tensor:
        return self._heads_first[0].transpose(1, 2)

    @property
    def v(self) -> torch.Tensor:
        return self._heads_first[1].transpose(1, 2)


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

    def new_static_cache(self, owner, batch_size: int, max_length: int) -> StaticKVCache:
        """Preallocated keys and values for `batch_size` rows of `max_length` tokens."""
        w = self.c_attn.weight
        shape = (batch_size, self.num_heads, max_length, self.hidden_size // self.num_heads)
        return StaticKVCache(owner, k=w.new_zeros(shape), v=w.new_zeros(shape))

    def forward(self, x: torch.Tensor, cache: KVCache | StaticKVCache | None = None) -> torch.Tensor:
        """x [B, T, hidden_size] -> y; with `cache`, attend over the cached keys/values and append."""
        check_mixer_input("MultiHeadAttention", x, self.hidden_size, cache)
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).view(B, T, 3, self.num_heads, -1).unbind(2)  # [B, T, H, D] each
        if cache is None:
            record_max_logits(self, q, k, q.shape[-1] ** -0.5)  # (a training step's, for QK-Clip)
            o, _ = attention(q, k, v, check_values=False)
        else:  # the cache's rows and this call's, then the last T positions attend over them
            k_all, v_all = cache.append(k=k, v=v)
            record_max_logits(self, q, k_all, q.shape[-1] ** -0.5, cache.pad)
            mask = cache.visible(T, k_all.shape[1], x.device) if cache.static else None
            o = causal_attention(q, k_all, v_all, scale=q.shape[-1] ** -0.5, start=cache.pad, mask=mask)
        return self.c_proj(o.reshape(B, T, self.hidden_size))
