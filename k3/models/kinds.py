"""The kinds of layer a model is made of, each described once.

Decoder layer i has a sequence mixer of kind `ModelConfig.layer_types[i]` and a feed-forward block of kind
`ModelConfig.mlp_types[i]`. Everything the rest of k3 needs to know about a kind is here, in one entry of
`MIXERS` or `FFNS`: what it requires of the config, how to build it, the decode cache it keeps (mixers),
how many parameters it has (and, for the MoE, how many a token leaves unused), and the bytes its cache
holds. `ModelConfig.validate`, `CausalLM`, `Cache`, `count_params` and the lab all read these
tables.

To add a mixer: write its layer in k3/layers, then add one `MixerKind` subclass (with the buffers of its cache) and
its entry in `MIXERS` below (plus any config fields it needs in `ModelConfig`). Nothing else switches on
the kind.

Cache bytes come in two parts: what grows with the sequence (`cache_bytes_per_token`: softmax attention's
keys and values, MLA's latents) and what does not (`state_bytes`: the linear family's recurrent state,
always float32, and its convolution states), at `dtype_bytes` per cached value.

Every method takes the model's `ModelConfig` as `c` (not imported here: the config imports these
tables to validate itself).
"""

from __future__ import annotations

import types
from typing import Iterator

import torch
from torch import nn

from ..inference.cache import Cache, LayerCache
from ..layers import (
    DeltaNet,
    GatedDeltaNet,
    GatedMLP,
    GeluMLP,
    KimiDeltaAttention,
    LinearAttention,
    MoE,
    MultiHeadAttention,
    MultiHeadLatentAttention,
)

STATE_BYTES = 4  # recurrent states are kept in float32


class MixerKind:
    """How one kind of sequence mixer enters a model. Subclasses fill in every method."""

    name: str
    fixed_state: bool  # decode state of constant size (the linear family) rather than a growing cache

    def check(self, c) -> Iterator[str]:
        """Problems with the config for this kind (each a sentence naming the field), if any."""
        return iter(())

    def build(self, c) -> nn.Module:
        raise NotImplementedError

    def new_cache(self, layer: nn.Module, owner, batch_size: int, slots: int) -> LayerCache:
        """`layer`'s decode state in `owner` (a `k3.inference.cache.Cache`) for `batch_size` rows of up to
        `slots` tokens, zeroed, on the layer's device, the tokens' buffers in its dtype."""
        raise NotImplementedError

    def params(self, c) -> int:
        """Parameters of one layer of this kind (its constructor's tensors, counted from the config)."""
        raise NotImplementedError

    def cache_bytes_per_token(self, c, dtype_bytes: int = 2) -> int:
        """Bytes one layer adds to its cache per token of one sequence."""
        return 0

    def state_bytes(self, c, dtype_bytes: int = 2) -> int:
        """Bytes one layer holds per sequence whatever its length."""
        return 0


class SoftmaxAttention(MixerKind):
    """GPT-2's multi-head attention: fused qkv and output projections with biases; a KV cache."""

    name, fixed_state = "mha", False

    def check(self, c):
        if not (c.num_heads > 0 and c.hidden_size % c.num_heads == 0):
            yield (
                f"`hidden_size` ({c.hidden_size}) must be divisible by `num_heads` ({c.num_heads}); pick a head "
                f"count that divides the width"
            )

    def build(self, c):
        return MultiHeadAttention(c.hidden_size, c.num_heads)

    def new_cache(self, layer, owner, batch_size, slots):
        """Keys and values head-major, [B, H, N, D] (their slot axis 2), what attention reads as they are."""
        w, H = layer.c_attn.weight, layer.num_heads
        shape = (batch_size, H, slots, layer.hidden_size // H)
        return LayerCache(owner, {"k": (w.new_zeros(shape), 2), "v": (w.new_zeros(shape), 2)})

    def params(self, c):
        d = c.hidden_size
        return d * 3 * d + 3 * d + d * d + d

    def cache_bytes_per_token(self, c, dtype_bytes=2):
        return 2 * c.hidden_size * dtype_bytes  # a key and a value of width d


class LatentAttention(MixerKind):
    """Multi-head Latent Attention: the cache holds the latent c and the shared k_pe per token, [c | k_pe]."""

    name, fixed_state = "mla", False

    def check(self, c):
        if c.num_heads <= 0:
            yield f"`num_heads` must be positive, got {c.num_heads}"
        for field in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            if getattr(c, field) <= 0:
                yield f"`{field}` must be positive, got {getattr(c, field)}"
        if c.qk_rope_head_dim < 0:
            yield f"`qk_rope_head_dim` must be >= 0, got {c.qk_rope_head_dim}"
        if not (c.q_lora_rank is None or c.q_lora_rank > 0):
            yield f"`q_lora_rank` must be None or positive, got {c.q_lora_rank}"

    def build(self, c):
        return MultiHeadLatentAttention(
            c.hidden_size,
            c.num_heads,
            q_lora_rank=c.q_lora_rank,
            kv_lora_rank=c.kv_lora_rank,
            qk_nope_head_dim=c.qk_nope_head_dim,
            qk_rope_head_dim=c.qk_rope_head_dim,
            v_head_dim=c.v_head_dim,
            output_gate="full" if c.mla_output_gate else None,
            rope_theta=c.rope_theta,
            # the latent norms keep DeepSeek's eps 1e-6 whatever rms_norm_eps says, as Kimi Linear does
            norm_eps=1e-6,
        )

    def new_cache(self, layer, owner, batch_size, slots):
        """`latents` [B, N, r + dr]: the normalised latent c and the shared rotary key k_pe of each token,
        side by side (vLLM's `kv_c_and_k_pe_cache`), so that decoding reads each slot once."""
        w = layer.kv_a_proj_with_mqa.weight
        return LayerCache(owner, {"latents": (w.new_zeros(batch_size, slots, layer.kv_lora_rank + layer.dr), 1)})

    def params(self, c):
        d, H, dn, dr, dv, r = (
            c.hidden_size,
            c.num_heads,
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
            c.kv_lora_rank,
        )
        rq = c.q_lora_rank
        q = d * H * (dn + dr) if rq is None else d * rq + rq + rq * H * (dn + dr)  # q_proj, or q_a, its norm, q_b
        gate = d * H * dv if c.mla_output_gate else 0
        return q + d * (r + dr) + r + r * H * (dn + dv) + gate + H * dv * d  # kv_a, its norm, kv_b, g, o

    def cache_bytes_per_token(self, c, dtype_bytes=2):
        return (c.kv_lora_rank + c.qk_rope_head_dim) * dtype_bytes


class _LinearFamily(MixerKind):
    fixed_state = True

    def check(self, c):
        if not (c.linear_num_heads > 0 and c.linear_head_dim > 0):
            yield (
                f"`linear_num_heads` and `linear_head_dim` must be positive, got {c.linear_num_heads} and "
                f"{c.linear_head_dim}"
            )
        if c.conv_size < 1:
            yield f"`conv_size` must be >= 1, got {c.conv_size}"

    def new_cache(self, layer, owner, batch_size, slots):
        """The recurrent state [B, H, K, V] in float32 (float64 in a float64 model) and the three short
        convolutions' window [B, 3 H K, W-1] (linear attention: the state (S, z), no convolutions)."""
        w = layer.q_proj.weight
        H, K, dtype = layer.num_heads, layer.head_dim, torch.promote_types(w.dtype, torch.float32)
        S = torch.zeros(batch_size, H, K, K, dtype=dtype, device=w.device)
        if isinstance(layer, LinearAttention):
            return LayerCache(owner, state=(S, torch.zeros(batch_size, H, K, dtype=dtype, device=w.device)))
        window = w.new_zeros(batch_size, 3 * H * K, layer.q_conv1d.kernel_size - 1)
        return LayerCache(owner, window=window, state=S)


class LinearAttentionKind(_LinearFamily):
    """Linear attention (ELU+1): q, k, v and o projections; the state (S, z) in float32."""

    name = "linear_attn"

    def build(self, c):
        return LinearAttention(c.hidden_size, c.linear_num_heads, c.linear_head_dim, chunk_size=c.chunk_size)

    def params(self, c):
        return 4 * c.hidden_size * c.linear_num_heads * c.linear_head_dim

    def state_bytes(self, c, dtype_bytes=2):
        H, K = c.linear_num_heads, c.linear_head_dim
        return STATE_BYTES * (H * K * K + H * K)  # S [H, K, V = K] and the normaliser z [H, K]


class DeltaRule(_LinearFamily):
    """DeltaNet, Gated DeltaNet and KDA: one body (q, k, v with short convolutions, beta, output norm and
    gate, o_proj); each subclass adds its forget gate."""

    layer: type

    def layer_options(self, c) -> dict:
        return dict(
            output_gate=c.linear_output_gate, conv_size=c.conv_size, norm_eps=c.norm_eps, chunk_size=c.chunk_size
        )

    def build(self, c):
        return self.layer(c.hidden_size, c.linear_num_heads, c.linear_head_dim, **self.layer_options(c))

    def forget_gate_params(self, c) -> int:
        return 0

    def params(self, c):
        d, H, K = c.hidden_size, c.linear_num_heads, c.linear_head_dim
        inner = H * K
        n = 3 * d * inner + 3 * inner * c.conv_size + d * H + K + inner * d  # q,k,v, convs, b_proj, o_norm, o_proj
        n += {"low_rank": d * K + K * inner, "full": d * inner, None: 0}[c.linear_output_gate]
        return n + self.forget_gate_params(c)

    def state_bytes(self, c, dtype_bytes=2):
        H, K = c.linear_num_heads, c.linear_head_dim
        return STATE_BYTES * H * K * K + 3 * H * K * (c.conv_size - 1) * dtype_bytes  # S [H, K, V = K]; q, k, v convs


class DeltaNetKind(DeltaRule):
    name, layer = "deltanet", DeltaNet


class GatedDeltaNetKind(DeltaRule):
    name, layer = "gated_deltanet", GatedDeltaNet

    def forget_gate_params(self, c):
        return c.hidden_size * c.linear_num_heads + 2 * c.linear_num_heads  # a_proj, A_log, dt_bias


class KimiDeltaAttentionKind(DeltaRule):
    name, layer = "kda", KimiDeltaAttention

    def layer_options(self, c):
        return {**super().layer_options(c), "kda_gate": c.kda_gate, "gate_lower_bound": c.kda_gate_lower_bound}

    def forget_gate_params(self, c):
        d, H, K = c.hidden_size, c.linear_num_heads, c.linear_head_dim
        return d * K + K * H * K + H + H * K  # f_a, f_b, A_log, dt_bias


MIXERS: dict[str, MixerKind] = {
    kind.name: kind
    for kind in (
        SoftmaxAttention(),
        LinearAttentionKind(),
        DeltaNetKind(),
        GatedDeltaNetKind(),
        KimiDeltaAttentionKind(),
        LatentAttention(),
    )
}


class FFNKind:
    """How one kind of feed-forward block enters a model."""

    name: str
    attribute: str  # the decoder layer's attribute, as the checkpoints name it

    def check(self, c) -> Iterator[str]:
        return iter(())

    def build(self, c) -> nn.Module:
        raise NotImplementedError

    def params(self, c) -> dict[str, int]:
        """Parameters of one block, by component (the keys of `count_params`' breakdown)."""
        raise NotImplementedError

    def unused_per_token(self, c) -> int:
        """Parameters of one block that a token does not multiply by (the unchosen routed experts)."""
        return 0


class DenseFFN(FFNKind):
    """GPT-2's GELU MLP, or a gated MLP (SwiGLU / SiTU-GLU) of width `intermediate_size`."""

    name, attribute = "dense", "mlp"

    def build(self, c):
        if c.ffn_activation == "gelu":
            return GeluMLP(c.hidden_size, c.intermediate_size)
        return GatedMLP(c.hidden_size, c.intermediate_size, c.ffn_activation, c.situ_beta, c.situ_linear_beta)

    def params(self, c):
        d, width = c.hidden_size, c.intermediate_size
        return {"dense FFN": 2 * d * width + width + d if c.ffn_activation == "gelu" else 3 * d * width}


class MixtureOfExperts(FFNKind):
    """Routed experts (in a latent space for K3) chosen top-k by a sigmoid router, plus shared experts."""

    name, attribute = "moe", "block_sparse_moe"

    def check(self, c):
        if not (c.num_experts > 0 and c.moe_intermediate_size > 0):
            yield (
                f"MoE layers need `num_experts` and `moe_intermediate_size` > 0, got {c.num_experts} and "
                f"{c.moe_intermediate_size}"
            )
        if not 1 <= c.num_experts_per_tok <= c.num_experts:
            yield (
                f"`num_experts_per_tok` ({c.num_experts_per_tok}) must be in [1, num_experts = {c.num_experts}]; "
                f"lower top-k or add experts"
            )
        if c.num_shared_experts < 0:
            yield f"`num_shared_experts` must be >= 0, got {c.num_shared_experts}"
        if c.ffn_activation == "gelu":
            yield "MoE experts are gated: `ffn_activation` must be 'swiglu' or 'situ'"
        if not (c.moe_latent_size is None or c.moe_latent_size > 0):
            yield f"`moe_latent_size` must be None or positive, got {c.moe_latent_size}"

    def build(self, c):
        return MoE(
            c.hidden_size,
            c.num_experts,
            c.num_experts_per_tok,
            c.moe_intermediate_size,
            num_shared=c.num_shared_experts,
            latent_dim=c.moe_latent_size,
            activation=c.ffn_activation,
            situ_beta=c.situ_beta,
            situ_linear_beta=c.situ_linear_beta,
            routed_scaling_factor=c.routed_scaling_factor,
            renormalize=c.moe_renormalize,
            norm_eps=c.norm_eps,
        )

    def _per_expert(self, c) -> int:
        return 3 * (c.moe_latent_size or c.hidden_size) * c.moe_intermediate_size

    def params(self, c):
        d = c.hidden_size
        parts = {"routed experts": c.num_experts * self._per_expert(c), "router": c.num_experts * d}
        if c.num_shared_experts:
            parts["shared experts"] = 3 * d * c.num_shared_experts * c.moe_intermediate_size
        if c.moe_latent_size:
            parts["latent projections"] = 2 * d * c.moe_latent_size + c.moe_latent_size  # down, up, latent norm
        return parts

    def unused_per_token(self, c):
        return (c.num_experts - c.num_experts_per_tok) * self._per_expert(c)


FFNS: dict[str, FFNKind] = {kind.name: kind for kind in (DenseFFN(), MixtureOfExperts())}
LAYER_KINDS = {  # the kind of each mixer layer class (a subclass, such as a lab variant, is its parent's)
    MultiHeadAttention: "mha",
    MultiHeadLatentAttention: "mla",
    LinearAttention: "linear_attn",
    DeltaNet: "deltanet",
    GatedDeltaNet: "gated_deltanet",
    KimiDeltaAttention: "kda",
}


def layer_cache(layer: nn.Module, batch_size: int, max_length: int | None = None) -> LayerCache:
    """`layer`'s decode state in a cache of its own (a one-layer `Cache`, made by the layer's kind): how a
    mixer layer decodes outside a model. Around each call the caller does what a model does for all its
    layers: `cache.owner.check_room(T)` before, `cache.owner.advance(T)` after."""
    kind = MIXERS[next(name for cls, name in LAYER_KINDS.items() if isinstance(layer, cls))]
    return Cache(_OneLayer(layer, kind), batch_size, max_length).layers[0]


class _OneLayer(nn.Module):
    """What `Cache` asks of a model, for one mixer layer."""

    def __init__(self, layer: nn.Module, kind: MixerKind):
        super().__init__()
        self.layer, self.kind = layer, kind
        self.config = types.SimpleNamespace(name=type(layer).__name__, num_layers=1, layer_types=[kind.name])

    def new_layer_cache(self, index: int, owner: Cache, batch_size: int, slots: int) -> LayerCache:
        return self.kind.new_cache(self.layer, owner, batch_size, slots)

    def new_depth_sources(self, batch_size: int) -> None:
        return None


def cache_bytes(c, batch_size: int, tokens: int, dtype_bytes: int = 2) -> int:
    """Bytes the decode cache of `batch_size` sequences of `tokens` tokens each holds, summed over the layers:
    per token, each attention layer's keys and values or latents; per sequence, the linear family's fixed
    states. What a static cache allocates, and a growing one reaches at that length."""
    per_token = sum(MIXERS[kind].cache_bytes_per_token(c, dtype_bytes) for kind in c.layer_types)
    fixed = sum(MIXERS[kind].state_bytes(c, dtype_bytes) for kind in c.layer_types)
    return batch_size * (per_token * tokens + fixed)
