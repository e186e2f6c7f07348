"""Multi-head Latent Attention (MLA), as in DeepSeek-V2/V3, Kimi Linear and Kimi K3.

    q            = q_b(RMSNorm(q_a(x)))  (query LoRA; q_proj(x) when q_lora_rank is None)  [B, T, H, dn + dr]
    [c | k_pe]   = kv_a_proj_with_mqa(x);  c = RMSNorm(c)                                   [B, T, r], [B, T, dr]
    [k_nope | v] = kv_b(c) per head                                                         [B, S, H, dn], [B, S, H, dv]
    key          = [k_nope | k_pe]  (k_pe shared by all heads; NoPE by default, RoPE optional)
    o            = softmax(q key^T / sqrt(dn + dr), causal) v
    gated MLA:   o <- o * sigmoid(g_proj(x))   (Kimi K3), then y = o_proj(o)

In a training step with QK-Clip on, each head's largest logit scale * q . key is recorded as well
(`max_logits` [H], k3.layers.max_logit; nothing at inference): k3.training.qk_clip bounds it.

The cache holds only the latent c and k_pe: r + dr values per token per layer (512 + 64 = 576 at K3
size), instead of H * (dn + dr + dv) for a plain KV cache. Decoding (and a short prefill piece over a
cache: `absorb_pays`) can "absorb" kv_b into the query and the output: q_nope . (W_uk c) =
(W_uk^T q_nope) . c and sum_s p_s W_uv c_s = W_uv (sum_s p_s c_s), so attention runs against the latents
directly; it equals the plain path. The latents live side by side, [c | k_pe] [B, N, r + dr] per token
(vLLM's `kv_c_and_k_pe_cache`), in a buffer of slots (`k3.inference.cache`, made by `k3.models.kinds`): a
decode step writes one slot per row, and its scores [W_uk^T q_nope | q_pe] . [c | k_pe] are one matmul
that reads each slot once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.attention import causal_attention, causal_mask
from ..ops.common import cast
from .checks import check_mixer_input
from .init import init_linear
from .joined import join, project
from .max_logit import record_max_logits
from .norm import RMSNorm, upcast

OUTPUT_GATES = (None, "full")


def rotate_half_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half layout) of x [B, T, *, d] at absolute `positions` [T] (or [B, T]:
    one per row)."""
    d = x.shape[-1]
    dtype = upcast(x).dtype
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=dtype) / d))
    angles = positions.to(dtype)[..., None] * inv_freq  # [(B,) T, d/2]
    shape = (-1 if positions.dim() == 2 else 1, x.shape[1], *([1] * (x.dim() - 3)), d)
    cos = torch.cat([angles.cos(), angles.cos()], -1).view(shape)
    sin = torch.cat([angles.sin(), angles.sin()], -1).view(shape)
    xf = upcast(x)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2 :]
    return (xf * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


class MultiHeadLatentAttention(nn.Module):
    """MLA with optional query LoRA, optional RoPE on the shared key part, and an optional sigmoid
    output gate (gated MLA: `output_gate="full"`, a full-rank g_proj as the linear family's "full").
    Parameter names follow the Kimi Linear / DeepSeek checkpoints."""

    record_max_logits = False  # set by k3.training.qk_clip for its training steps
    max_logits: torch.Tensor | None = None  # [H]: the largest logit of each head since it was cleared

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        output_gate: str | None = None,
        rope_theta: float | None = None,
        norm_eps: float = 1e-6,
    ):
        super().__init__()
        if output_gate not in OUTPUT_GATES:
            raise ValueError(f"MultiHeadLatentAttention: `output_gate` must be None or 'full', got {output_gate!r}")
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.dn, self.dr, self.dv = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.rope_theta = rope_theta
        self.scale = (qk_nope_head_dim + qk_rope_head_dim) ** -0.5
        q_dim = num_heads * (qk_nope_head_dim + qk_rope_head_dim)
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, q_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps=norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, q_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps=norm_eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.g_proj = nn.Linear(hidden_size, num_heads * v_head_dim, bias=False) if output_gate else None
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self, std: float | None = None, residual_std: float | None = None) -> None:
        """See k3.layers.init: projections ~ N(0, std), o_proj ~ N(0, residual_std), latent norms 1."""
        queries = (self.q_proj,) if self.q_lora_rank is None else (self.q_a_proj, self.q_b_proj)
        gate = () if self.g_proj is None else (self.g_proj,)
        for linear in (*queries, self.kv_a_proj_with_mqa, self.kv_b_proj, *gate):
            init_linear(linear, std)
        init_linear(self.o_proj, std if residual_std is None else residual_std)
        for norm in (self.kv_a_layernorm,) + (() if self.q_lora_rank is None else (self.q_a_layernorm,)):
            norm.reset_parameters()

    def _queries_and_latents(self, x: torch.Tensor, positions: torch.Tensor | int = 0, projected=None):
        """Queries [B, T, H, dn + dr], latents c [B, T, r] and k_pe [B, T, dr] of x, whose tokens sit at
        `positions` ([T], or [B, T]: one per row, as a cache gives them) or, for an int p, p ... p + T - 1.
        `projected`: (q_proj(x) or q_a_proj(x), kv_a_proj_with_mqa(x)) when already computed."""
        B, T, _ = x.shape
        if projected is None:
            projected = (self.q_proj(x) if self.q_lora_rank is None else self.q_a_proj(x), self.kv_a_proj_with_mqa(x))
        q, latents = projected
        q = q if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(B, T, self.num_heads, self.dn + self.dr)
        c, k_pe = torch.split(latents, [self.kv_lora_rank, self.dr], dim=-1)
        c = self.mix_latents(self.kv_a_layernorm(c))
        if self.rope_theta is not None:  # NoPE unless asked: the rope part is carried, never rotated
            if isinstance(positions, int):
                positions = torch.arange(positions, positions + T, device=x.device)
            q = torch.cat([q[..., : self.dn], rotate_half_rope(q[..., self.dn :], positions, self.rope_theta)], -1)
            k_pe = rotate_half_rope(k_pe.unsqueeze(2), positions, self.rope_theta).squeeze(2)
        return q, c, k_pe

    def mix_latents(self, c: torch.Tensor) -> torch.Tensor:
        """Hook: the normalised latents c [B, T, r] become what keys and values are expanded from, and what a
        cache keeps; here unchanged, c. A variant overrides it (k3 lab's `ConvLatentAttention`: a causal
        convolution over t, c'_t = sum_j w_j * c_{t-j}). It sees only the call's tokens, so a variant that mixes
        over t has no decoding cache."""
        return c

    def forward(
        self,
        x: torch.Tensor,
        cache=None,
        absorb: bool | None = None,
        fused: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, T, hidden_size] -> y [B, T, hidden_size]. With `cache`, attend over its latents too
        and append this call's. `absorb` (default: with a cache, when it pays for T tokens, `absorb_pays`)
        runs attention against the latents with kv_b folded into the query and the output. `fused`: the
        decode step's joined copy of the input projections (`fuse_for_decoding`), one matmul instead of two
        or three."""
        check_mixer_input("MultiHeadLatentAttention", x, self.hidden_size, cache)
        B, T, _ = x.shape
        first, latents, *gate = project(x, self._input_projections(), fused)
        rotated = cache is not None and self.rope_theta is not None
        positions = cache.token_positions(T, x.device) if rotated else 0
        q, c, k_pe = self._queries_and_latents(x, positions, (first, latents))
        if cache is None:
            c_all, k_pe_all, mask = c, k_pe, None
        else:  # the cache's slots [c | k_pe] [B, S, r + dr]
            latents = cache.append(latents=torch.cat([c, k_pe], -1))[0]
            c_all, k_pe_all = latents.split([self.kv_lora_rank, self.dr], -1)
            mask = cache.visible(T, latents.shape[1], x.device)
        if absorb is None:
            absorb = cache is not None and self.absorb_pays(T)
        if absorb:
            o = self._absorbed(q, torch.cat([c, k_pe], -1) if cache is None else latents, mask)
        else:
            o = self._plain(q, c_all, k_pe_all, mask)
        o = o.reshape(B, T, self.num_heads * self.dv)
        if gate:  # gated MLA
            o = o * torch.sigmoid(gate[0])
        return self.o_proj(o)

    def absorb_pays(self, T: int) -> bool:
        """Whether T queries attend over cached latents with fewer multiply-adds absorbed. Per cached slot,
        the plain path expands the latent into every head's key and value (H (dn + dv) r) and scores and
        sums T queries against them (T H (dn + dr + dv)); the absorbed path scores and sums T H rows
        against [c | k_pe] itself (T H 2 (r + dr)). So absorb when T (2 (r + dr) - (dn + dr + dv)) <
        (dn + dv) r: always for one token, below 128 tokens at the tiny presets' sizes and 158 at Kimi K3's
        (DeepSeek-V3's) -- a prefill piece after a prefix-cache hit, not a long prompt's."""
        per_query = 2 * (self.kv_lora_rank + self.dr) - (self.dn + self.dr + self.dv)
        return per_query <= 0 or T * per_query < (self.dn + self.dv) * self.kv_lora_rank

    def _input_projections(self) -> list[nn.Linear]:
        """The projections of x, in the order `fuse_for_decoding` joins them: the query's first (q_proj or
        q_a_proj), the latents' (kv_a_proj_with_mqa) and the output gate's (g_proj, when gated)."""
        first = self.q_proj if self.q_lora_rank is None else self.q_a_proj
        return [first, self.kv_a_proj_with_mqa] + ([self.g_proj] if self.g_proj is not None else [])

    def fuse_for_decoding(self) -> torch.Tensor:
        """The input projections' weights joined, [rows of all, hidden_size] (`k3.layers.joined`): what a
        decode step passes to `forward` as `fused`."""
        return join(self._input_projections())

    def _plain(self, q, c_all, k_pe_all, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Expand every cached latent to per-head keys and values, then causal softmax attention of the
        T queries (the last T slots) over all S slots (or the slots `mask` [B, 1, T, S] allows: a cache's
        rows at their own positions)."""
        B, S, _ = c_all.shape
        kv = self.kv_b_proj(c_all).view(B, S, self.num_heads, self.dn + self.dv)
        k_nope, v = torch.split(kv, [self.dn, self.dv], dim=-1)
        k = torch.cat([k_nope, k_pe_all.unsqueeze(2).expand(B, S, self.num_heads, self.dr)], dim=-1)
        record_max_logits(self, q, k, self.scale)  # (a training step's, for QK-Clip)
        return causal_attention(q, k, v, self.scale, mask=mask)  # [B, T, H, dv]

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b's two halves per head: W_uk [H, dn, r] (latent -> key) and W_uv [H, dv, r] (latent -> value)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.dn + self.dv, self.kv_lora_rank)
        return w[:, : self.dn], w[:, self.dn :]

    def _latent_queries(self, q: torch.Tensor) -> torch.Tensor:
        """q [B, T, H, dn + dr] -> [W_uk^T q_nope | q_pe] [B, H*T, r + dr] (rows head-major: h * T + i), the
        queries that score against the latents [c | k_pe]."""
        B, T, H, _ = q.shape
        w_uk = self._absorbed_weights()[0]
        q_nope = q[..., : self.dn].permute(2, 0, 1, 3).reshape(H, B * T, self.dn)
        q_latent = torch.bmm(q_nope, w_uk).view(H, B, T, -1).transpose(0, 1).reshape(B, H * T, -1)  # [B, H*T, r]
        return torch.cat([q_latent, q[..., self.dn :].transpose(1, 2).reshape(B, H * T, self.dr)], -1)

    def _latent_mask(self, B: int, T: int, S: int, mask: torch.Tensor | None, device) -> torch.Tensor | None:
        """Which slots the head-major query rows h * T + i see: [B or 1, 1, H*T, S], or None (all)."""
        allowed = causal_mask(T, S, None, device) if mask is None else mask  # None: one query sees every slot
        if allowed is None or T == 1:
            return allowed if allowed is None or allowed.dim() == 4 else allowed.view(1, 1, 1, S)
        allowed = allowed.view(-1, 1, T, S)
        return allowed.expand(allowed.shape[0], self.num_heads, T, S).reshape(-1, 1, self.num_heads * T, S)

    def _latent_probs(self, q, latents, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention probabilities [B, H*T, S] (rows head-major: h * T + i; in q's dtype) against
        the latents [c | k_pe] [B, S, r + dr], with scores = [W_uk^T q_nope | q_pe] . [c | k_pe]; query i
        sits at slot S - T + i, or sees the slots `mask` [B, 1, T, S] allows (a cache's rows at their own
        positions). The heads are folded into the rows, so the latents (shared by every head) are read as
        they are, never expanded or copied."""
        B, T, _, _ = q.shape
        S = latents.shape[1]
        scores = upcast(torch.bmm(self._latent_queries(q), latents.transpose(1, 2))).mul_(self.scale)
        allowed = self._latent_mask(B, T, S, mask, q.device)
        if allowed is not None:
            scores = scores.masked_fill(~allowed[:, 0], float("-inf"))
        return cast(torch.softmax(scores, dim=-1), q.dtype)

    def _absorbed(self, q, latents, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attention against the latents [c | k_pe] [B, S, r + dr] -> [B, T, H, dv]: o = W_uv (p . c) per
        head, p = softmax([W_uk^T q_nope | q_pe] . [c | k_pe] * scale) as `_latent_probs` gives it.

        One fused attention (`scaled_dot_product_attention`: a flash kernel, each slot read once with an
        online softmax) of the H*T query rows over one shared key-and-value head, the latents themselves:
        its output's first r columns are p . c (the last dr, p . k_pe, are dropped)."""
        B, T, H, _ = q.shape
        S, r = latents.shape[1], self.kv_lora_rank
        queries = self._latent_queries(q).unsqueeze(1)  # [B, 1, H*T, r + dr]
        kv = latents.unsqueeze(1)  # [B, 1, S, r + dr]
        allowed = self._latent_mask(B, T, S, mask, q.device)
        o_latent = F.scaled_dot_product_attention(queries, kv, kv, attn_mask=allowed, scale=self.scale)
        o_latent = o_latent[:, 0, :, :r].reshape(B, H, T, r).transpose(0, 1).reshape(H, B * T, r)  # [H, B*T, r]
        o = torch.bmm(o_latent, self._absorbed_weights()[1].transpose(1, 2))  # [H, B*T, dv]
        return o.view(H, B, T, self.dv).permute(1, 2, 0, 3)

    def attention_probs(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden_size] -> the attention probabilities [B, H, T, T] of each head over the sequence
        (causal, no cache): the absorbed path's own softmax, which `forward` decodes with."""
        check_mixer_input("MultiHeadLatentAttention", x, self.hidden_size, None)
        q, c, k_pe = self._queries_and_latents(x, 0)
        B, T, H, _ = q.shape
        return self._latent_probs(q, torch.cat([c, k_pe], -1)).view(B, H, T, T)
