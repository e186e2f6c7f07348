"""The decoder of every preset: embeddings, the stack of layers (a mixer of the layer's kind and an FFN, each
behind a pre-norm residual or a Block AttnRes read), the final norm (docs/design.md: models).

`Decoder(input_ids, caches, positions, sources, fused)` is what `CausalLM` runs for training, prefill and
decoding alike, and what a decode step compiles: the caches, positions and fused weight copies are passed in,
never kept.
"""

from __future__ import annotations

import torch
from torch import nn

from ..inference.packed import PackedLayerCache
from ..layers import BlockAttnRes, DepthSources, RMSNorm
from .config import ModelConfig
from .kinds import FFNS, MIXERS


def build_norm(config: ModelConfig, dim: int) -> nn.Module:
    if config.norm == "layernorm":
        return nn.LayerNorm(dim, eps=config.norm_eps)
    return RMSNorm(dim, eps=config.norm_eps)


def starts_attn_res_block(config: ModelConfig, index: int) -> bool:
    """Whether decoder layer `index` starts a Block AttnRes block (and so makes the running sum a source)."""
    return config.attn_res_block_size is not None and index % config.attn_res_block_size == 0


def attn_res_source_counts(config: ModelConfig) -> list[int]:
    """How many sources each AttnRes mix reads, in the order the decoder runs them: before attention and
    before the FFN of every layer, then the final one ([] without AttnRes)."""
    if config.attn_res_block_size is None:
        return []
    blocks, counts = 0, []
    for i in range(config.num_layers):
        if starts_attn_res_block(config, i):
            blocks += 1
            counts.append(blocks)  # the completed sources only: the new running sum is still empty
        else:
            counts.append(blocks + 1)
        counts.append(blocks + 1)
    return counts + [blocks + 1]


def _given(fused) -> dict:
    """The keyword that hands a layer its decode-time weight copies, when it has some."""
    return {} if fused is None else {"fused": fused}


class DecoderLayer(nn.Module):
    """Pre-norm mixer + FFN (Kimi Linear names), with the two AttnRes queries when the model uses them."""

    def __init__(self, config: ModelConfig, index: int):
        super().__init__()
        self.layer_type, self.mlp_type = config.layer_types[index], config.mlp_types[index]
        self.starts_block = starts_attn_res_block(config, index)
        self.input_layernorm = build_norm(config, config.hidden_size)
        self.self_attn = MIXERS[self.layer_type].build(config)
        self.post_attention_layernorm = build_norm(config, config.hidden_size)
        ffn = FFNS[self.mlp_type]
        setattr(self, ffn.attribute, ffn.build(config))
        self._ffn_attribute = ffn.attribute
        self.attn_res = self.mlp_res = None
        if config.attn_res_block_size is not None:
            self.attn_res = BlockAttnRes(config.hidden_size, eps=config.norm_eps)
            self.mlp_res = BlockAttnRes(config.hidden_size, eps=config.norm_eps)

    @property
    def ffn(self) -> nn.Module:
        """The feed-forward block: `mlp` (dense) or `block_sparse_moe` (MoE)."""
        return getattr(self, self._ffn_attribute)

    def forward(
        self,
        x: torch.Tensor | None,
        cache=None,
        blocks: list[torch.Tensor] | DepthSources = (),
        fused: tuple = (None, None),
    ) -> torch.Tensor:
        """The whole layer: x [B, T, d] -> x + attention, then + FFN (pre-norm), updating `cache`.

        With Block AttnRes, x is the current block's partial sum (None in a block's first layer, where
        the decoder has just made the previous sum a source) and `blocks` the completed sources; each
        sub-layer reads a depth mix of [*blocks, x] instead of x (`blocks` may be a static decode step's
        `DepthSources` buffer). `fused`: (the mixer's, the FFN's) weight copies a decode step passes
        (`k3.layers.joined`; None where there are none). A `PackedLayerCache` (`k3.inference.packed`) holds
        several rows' tokens packed along T: the mixer runs per group of rows, the rest over every token.
        Returns the new partial sum."""
        mixer_fused, ffn_fused = fused
        h = self.input_layernorm(self._read(self.attn_res, blocks, x))
        if isinstance(cache, PackedLayerCache):  # several rows' tokens packed along T: the mixer group by group
            out = cache.mix(self.self_attn, h)
        else:
            out = self.self_attn(h, cache=cache, **_given(mixer_fused))
        x = out if x is None else x + out
        return x + self.ffn(self.post_attention_layernorm(self._read(self.mlp_res, blocks, x)), **_given(ffn_fused))

    @staticmethod
    def _read(mix: BlockAttnRes | None, blocks, x: torch.Tensor | None) -> torch.Tensor:
        if mix is None:  # a plain residual stream
            return x
        if isinstance(blocks, DepthSources):
            return blocks.read(mix, x)
        return mix(list(blocks) if x is None else [*blocks, x])


class Decoder(nn.Module):
    """Embeddings, layers and the final norm (the checkpoints' `model.` prefix)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.max_position_embeddings:
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.final_res = None
        if config.attn_res_block_size is not None:
            self.final_res = BlockAttnRes(config.hidden_size, eps=config.norm_eps)
        self.norm = build_norm(config, config.hidden_size)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings. An id outside the vocabulary is torch's IndexError on the CPU, said here as a
        ValueError naming `input_ids` once it has happened (no check before: that would read the ids back from
        the device every call; k3's boundaries — generate, the engine, the server — check ids before)."""
        if torch.compiler.is_compiling():
            return self.embed_tokens(input_ids)
        try:
            return self.embed_tokens(input_ids)
        except IndexError:
            raise ValueError(
                f"CausalLM: `input_ids` must be token ids in [0, {self.config.vocab_size}) (the vocabulary), got "
                f"ids from {int(input_ids.min())} to {int(input_ids.max())}"
            ) from None

    def forward(
        self,
        input_ids: torch.Tensor,
        caches: list | None,
        positions: torch.Tensor | None = None,
        sources: torch.Tensor | None = None,
        fused: list[tuple] | None = None,
    ) -> torch.Tensor:
        """input_ids [B, T] at `positions` ([T] or [B, T]: each row's own, as the cache gives them; None:
        0 ... T - 1), continuing the layer `caches` when given -> the final hidden states [B, T, d].
        `sources`: a buffer [n, B, T, d] for the Block AttnRes sources (a static decode step's). `fused`:
        each layer's weight copies (`CausalLM.decoding_weights`: decoding's)."""
        x = self.embed(input_ids)
        if self.config.max_position_embeddings:
            if positions is None:
                positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            x = x + self.embed_positions(positions.to(input_ids.device))
        # Block AttnRes: the completed sources, the embedding first
        blocks: list[torch.Tensor] | DepthSources = [] if sources is None else DepthSources(sources)
        none = [None] * len(self.layers)
        for layer, cache, copies in zip(self.layers, caches or none, fused or [(None, None)] * len(self.layers)):
            if layer.starts_block:  # the running sum becomes a source of its own
                if isinstance(blocks, DepthSources):
                    blocks.add(x)
                else:
                    blocks = blocks + [x]
                x = None
            x = layer(x, cache, blocks, copies)
        if self.final_res is not None:
            x = self.final_res(blocks + [x]) if isinstance(blocks, list) else blocks.read(self.final_res, x)
        return self.norm(x)
