"""CausalLM: one decoder for the whole lineage (DESIGN.md §4), with the hybrid decode cache (§5).

    tokens -> embed_tokens (+ embed_positions, GPT-2 only)
           -> layers: x + self_attn(input_layernorm(x)), then x + mlp(post_attention_layernorm(x))
           -> norm -> lm_head (tied to embed_tokens for GPT-2)

With Block Attention Residuals (Kimi K3) the residual stream is replaced by depth attention: each
sub-layer reads h = attn_res(sources) over sources = [embedding, completed block sums, the current
block's partial sum]; its output is added to the partial sum; a new block starts every
`attn_res_block_size` layers (the embedding is snapshotted as the first source at layer 0), and the
final norm reads final_res(sources).

Parameter names follow the Kimi Linear checkpoints: model.embed_tokens, model.layers.N.self_attn,
.input_layernorm, .post_attention_layernorm, .mlp (dense) or .block_sparse_moe (MoE), model.norm,
lm_head. AttnRes adds model.layers.N.attn_res / .mlp_res and model.final_res.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
from torch import nn

from ..layers import (
    BlockAttnRes, DeltaNet, Expert, GatedDeltaNet, GatedMLP, GeluMLP, KimiDeltaAttention, KVCache, LatentCache,
    LinearAttention, MoE, MultiHeadAttention, MultiHeadLatentAttention, RecurrentCache, RMSNorm, Router,
)
from .config import ModelConfig

_RESIDUAL_OUTPUTS = ("o_proj", "c_proj", "down_proj", "latent_up_proj")


def build_mixer(config: ModelConfig, kind: str) -> nn.Module:
    c = config
    if kind == "mha":
        return MultiHeadAttention(c.hidden_size, c.num_heads)
    if kind == "mla":
        return MultiHeadLatentAttention(
            c.hidden_size, c.num_heads, q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
            qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
            # the latent norms keep DeepSeek's eps 1e-6 whatever rms_norm_eps says, as Kimi Linear does
            output_gate=c.mla_output_gate, rope_theta=c.rope_theta, norm_eps=1e-6)
    if kind == "linear_attn":
        return LinearAttention(c.hidden_size, c.linear_num_heads, c.linear_head_dim, chunk_size=c.chunk_size)
    common = dict(output_gate=c.linear_output_gate, conv_size=c.conv_size, norm_eps=c.norm_eps,
                  chunk_size=c.chunk_size)
    if kind == "deltanet":
        return DeltaNet(c.hidden_size, c.linear_num_heads, c.linear_head_dim, **common)
    if kind == "gated_deltanet":
        return GatedDeltaNet(c.hidden_size, c.linear_num_heads, c.linear_head_dim, **common)
    return KimiDeltaAttention(c.hidden_size, c.linear_num_heads, c.linear_head_dim, gate=c.kda_gate, **common)


def build_ffn(config: ModelConfig, kind: str) -> nn.Module:
    c = config
    if kind == "moe":
        return MoE(c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                   num_shared=c.num_shared_experts, latent_dim=c.moe_latent_size, activation=c.ffn_activation,
                   situ_beta=c.situ_beta, situ_linear_beta=c.situ_linear_beta,
                   routed_scaling_factor=c.routed_scaling_factor, norm_eps=c.norm_eps)
    if c.ffn_activation == "gelu":
        return GeluMLP(c.hidden_size, c.intermediate_size)
    return GatedMLP(c.hidden_size, c.intermediate_size, c.ffn_activation, c.situ_beta, c.situ_linear_beta)


def build_norm(config: ModelConfig, dim: int) -> nn.Module:
    if config.norm == "layernorm":
        return nn.LayerNorm(dim, eps=config.norm_eps)
    return RMSNorm(dim, eps=config.norm_eps)


def new_layer_cache(kind: str):
    if kind == "mha":
        return KVCache()
    if kind == "mla":
        return LatentCache()
    return RecurrentCache()


class HybridCache:
    """Decode state of a whole model: per layer a KVCache (MHA), LatentCache (MLA: c and k_pe only) or
    RecurrentCache (linear family: conv states and the fixed-size recurrent state). Updated in place by
    every forward; `length` counts the tokens it has seen."""

    def __init__(self, config: ModelConfig, batch_size: int):
        self.config, self.batch_size, self.length = config, batch_size, 0
        self.layers = [new_layer_cache(kind) for kind in config.layer_types]

    def nbytes(self) -> int:
        """Bytes held by all layers' caches."""
        return sum(c.nbytes() for c in self.layers)

    def nbytes_by_type(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for kind, c in zip(self.config.layer_types, self.layers):
            out[kind] = out.get(kind, 0) + c.nbytes()
        return out

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.config.name!r}, batch_size={self.batch_size}, length={self.length}, "
                f"nbytes={self.nbytes():,})")


class DecoderLayer(nn.Module):
    """Pre-norm mixer + FFN (Kimi Linear names), with the two AttnRes queries when the model uses them."""

    def __init__(self, config: ModelConfig, index: int):
        super().__init__()
        self.layer_type, self.mlp_type = config.layer_types[index], config.mlp_types[index]
        self.input_layernorm = build_norm(config, config.hidden_size)
        self.self_attn = build_mixer(config, self.layer_type)
        self.post_attention_layernorm = build_norm(config, config.hidden_size)
        ffn = build_ffn(config, self.mlp_type)
        if self.mlp_type == "moe":
            self.block_sparse_moe = ffn
        else:
            self.mlp = ffn
        if config.attn_res_block_size is not None:
            self.attn_res = BlockAttnRes(config.hidden_size, eps=config.norm_eps)
            self.mlp_res = BlockAttnRes(config.hidden_size, eps=config.norm_eps)

    @property
    def ffn(self) -> nn.Module:
        return self.block_sparse_moe if self.mlp_type == "moe" else self.mlp

    def attention_output(self, h: torch.Tensor, cache=None) -> torch.Tensor:
        return self.self_attn(self.input_layernorm(h), cache=cache)

    def ffn_output(self, h: torch.Tensor) -> torch.Tensor:
        return self.ffn(self.post_attention_layernorm(h))

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        x = x + self.attention_output(x, cache)
        return x + self.ffn_output(x)


class Decoder(nn.Module):
    """Embeddings, layers and the final norm (the checkpoints' `model.` prefix)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.max_position_embeddings:
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        if config.attn_res_block_size is not None:
            self.final_res = BlockAttnRes(config.hidden_size, eps=config.norm_eps)
        self.norm = build_norm(config, config.hidden_size)

    def forward(self, input_ids: torch.Tensor, caches: list | None, past: int) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.config.max_position_embeddings:
            T = input_ids.shape[1]
            x = x + self.embed_positions(torch.arange(past, past + T, device=input_ids.device))
        caches = caches or [None] * len(self.layers)
        if self.config.attn_res_block_size is None:
            for layer, cache in zip(self.layers, caches):
                x = layer(x, cache)
            return self.norm(x)
        return self.norm(self._attn_res_forward(x, caches))

    def _attn_res_forward(self, x: torch.Tensor, caches: list) -> torch.Tensor:
        """Block Attention Residuals: sub-layers read depth mixes of [embedding, block sums, partial]."""
        block = self.config.attn_res_block_size
        blocks: list[torch.Tensor] = []
        partial: torch.Tensor | None = x
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            h = layer.attn_res(blocks + [partial])
            if i % block == 0:  # block boundary: the running sum becomes a source of its own
                blocks.append(partial)
                partial = None
            out = layer.attention_output(h, cache)
            partial = out if partial is None else partial + out
            partial = partial + layer.ffn_output(layer.mlp_res(blocks + [partial]))
        return self.final_res(blocks + [partial])


class CausalLM(nn.Module):
    """A decoder-only language model of the lineage; see the module docstring and `ModelConfig`."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.reset_parameters()

    # -- initialisation -------------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """GPT-2 style: weights ~ N(0, std), biases 0, the projections that write into the residual
        stream scaled by 1/sqrt(2 * num_layers); norms 1; each layer's own special initialisation is
        kept (A_log, dt_bias, short convolutions, AttnRes queries at zero). No-op on the meta device."""
        if self.lm_head.weight.is_meta:
            return
        out_std = std / math.sqrt(2 * self.config.num_layers)
        for name, module in self.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if isinstance(module, nn.Linear) and not name.endswith(("attn_res.proj", "mlp_res.proj", "final_res.proj")):
                nn.init.normal_(module.weight, std=out_std if leaf in _RESIDUAL_OUTPUTS else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, Expert):
                nn.init.normal_(module.w1, std=std)
                nn.init.normal_(module.w3, std=std)
                nn.init.normal_(module.w2, std=out_std)
            elif isinstance(module, Router):
                nn.init.normal_(module.weight, std=std)

    # -- inference ----------------------------------------------------------------------------------
    def new_cache(self, batch_size: int) -> HybridCache:
        """An empty decode cache for `batch_size` sequences."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"new_cache: `batch_size` must be a positive int, got {batch_size!r}")
        return HybridCache(self.config, batch_size)

    def forward(self, input_ids: torch.Tensor, cache: HybridCache | None = None) -> torch.Tensor:
        """input_ids [B, T] (int64) -> logits [B, T, vocab_size]. With `cache`, continue after the tokens
        it has seen and leave the new state in it (T > 1: chunked prefill; T = 1: recurrent decode step)."""
        self._check_input(input_ids, cache)
        past = 0 if cache is None else cache.length
        hidden = self.model(input_ids, None if cache is None else cache.layers, past)
        if cache is not None:
            cache.length += input_ids.shape[1]
        return self.lm_head(hidden)

    def _check_input(self, input_ids: torch.Tensor, cache: HybridCache | None) -> None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            got = list(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"CausalLM: `input_ids` must be a [B, T] tensor of token ids, got {got}")
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"CausalLM: `input_ids` must be int64 (or int32), got {input_ids.dtype}")
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size):
            raise ValueError(f"CausalLM: token ids must be in [0, {self.config.vocab_size}); got ids from "
                             f"{int(input_ids.min())} to {int(input_ids.max())} (does the tokenizer match the model?)")
        if cache is not None:
            if not isinstance(cache, HybridCache):
                raise ValueError(f"CausalLM: `cache` must come from model.new_cache(), got {type(cache).__name__}")
            if cache.config != self.config:
                raise ValueError(f"CausalLM: this cache was made for another model ({cache.config.name!r}); "
                                 f"make one with this model's new_cache()")
            if cache.batch_size != input_ids.shape[0]:
                raise ValueError(f"CausalLM: the cache was made for batch size {cache.batch_size}, `input_ids` "
                                 f"has batch size {input_ids.shape[0]}; make a new cache with "
                                 f"new_cache({input_ids.shape[0]})")
        positions = self.config.max_position_embeddings
        if positions and (0 if cache is None else cache.length) + input_ids.shape[1] > positions:
            raise ValueError(f"CausalLM: {self.config.name!r} has learned positions for {positions} tokens; "
                             f"this call would reach position {(0 if cache is None else cache.length) + input_ids.shape[1]}")

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, eos_token_id: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Prompt [B, T] -> [B, T + n] with n <= max_new_tokens sampled tokens (temperature 0: greedy).
        Stops early once every sequence has produced `eos_token_id` (later positions repeat it)."""
        from ..generation import generate

        return generate(self, input_ids, max_new_tokens, temperature, top_k, top_p, eos_token_id, generator)

    def stream(self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
               top_k: int | None = None, top_p: float | None = None, eos_token_id: int | None = None,
               generator: torch.Generator | None = None) -> Iterator[torch.Tensor]:
        """As `generate`, yielding each new token [B] as soon as it is sampled."""
        from ..generation import stream

        return stream(self, input_ids, max_new_tokens, temperature, top_k, top_p, eos_token_id, generator)

    # -- weights in and out ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | None = None) -> "CausalLM":
        """Load a k3 checkpoint or a Kimi Linear / Kimi K3 checkpoint (Hub or transformers layout)
        from a directory with config.json and safetensors weights."""
        from .checkpoint import from_pretrained

        return from_pretrained(path, dtype)

    def save_pretrained(self, path) -> None:
        """Write config.json and model.safetensors (k3 layout), never leaving a half-written file."""
        from .checkpoint import save_pretrained

        save_pretrained(self, path)

    # -- training helpers ---------------------------------------------------------------------------
    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def update_moe_bias(self, rate: float = 1e-3) -> None:
        """Aux-loss-free balancing step for every MoE layer, from its last forward's expert load."""
        for moe in self.moe_layers():
            if moe.last_load is not None:
                moe.update_bias(rate=rate)

    def num_parameters(self) -> int:
        """Distinct parameters (a tied head counts once)."""
        return sum(p.numel() for p in self.parameters())
