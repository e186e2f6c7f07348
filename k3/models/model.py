"""CausalLM: one decoder for the whole lineage, with its decode cache (docs/design.md: models, the caches).

    tokens -> embed_tokens (+ embed_positions, GPT-2 only)
           -> layers: x + self_attn(input_layernorm(x)), then x + mlp(post_attention_layernorm(x))
           -> norm -> lm_head (tied to embed_tokens for GPT-2)

With Block Attention Residuals (Kimi K3) the residual stream is replaced by depth attention: each
sub-layer reads h = attn_res(sources) over sources = [embedding, completed block sums, the current
block's partial sum] instead of x; its output is added to the partial sum. The first layer of every
block of `attn_res_block_size` layers (layers 0, B, 2B, ...) turns the running sum into a source of its
own (at layer 0: the embedding) and starts a new one; the final norm reads final_res(sources).

Each layer's mixer and FFN come from the kinds tables (`k3.models.kinds`). Parameter names follow the
Kimi Linear checkpoints: model.embed_tokens, model.layers.N.self_attn, .input_layernorm,
.post_attention_layernorm, .mlp (dense) or .block_sparse_moe (MoE), model.norm, lm_head. AttnRes adds
model.layers.N.attn_res / .mlp_res and model.final_res.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
from torch import nn

from ..checkpoints import checkpoint, loading
from ..inference import generation
from ..inference.cache import Cache
from ..layers import MoE, init
from ..layers.init import STD
from ..runtime import refuse_if_over_memory
from .config import ModelConfig
from .decoder import Decoder
from .kinds import MIXERS, cache_bytes
from .loss import IGNORE_INDEX, head_cross_entropy

# Tokens per forward when a long input runs into a cache: prefill memory grows linearly with the prompt
# (the recurrent states are fixed; attention scores are at most a piece of queries by the cached keys).
PREFILL_PIECE = 2048


class CausalLM(nn.Module):
    """A decoder-only language model of the lineage; see the module docstring and `ModelConfig`."""

    config_class = ModelConfig  # what from_pretrained reads config.json into (k3.checkpoints.loading)

    def __init__(self, config: ModelConfig):
        super().__init__()
        if not isinstance(config, ModelConfig):
            hint = f"CausalLM(get_config({config!r}))" if isinstance(config, str) else "CausalLM(get_config(name))"
            raise TypeError(
                f"CausalLM takes a ModelConfig, got {type(config).__name__} {config!r:.60}: {hint} "
                f"builds a preset, CausalLM.from_pretrained(folder) loads a checkpoint"
            )
        self.config = config
        # the seed of this model's weights: the global generator's next draw, taken first, so a model
        # built on the meta device (whose layers draw nothing) gets the same one as a model built whole
        self.init_seed = int(torch.empty((), dtype=torch.int64, device="cpu").random_(0, 2**62))
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.reset_parameters()

    # -- initialisation -------------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self, std: float = STD) -> None:
        """GPT-2's scheme (k3.layers.init): embeddings and projections ~ N(0, std), the projections that
        write into the residual stream ~ N(0, std / sqrt(2 * num_layers)), norms 1; each layer sets its
        own parameters, special ones included. No-op on the meta device.

        Each parameter's values depend on `init_seed` and its name alone (`k3.layers.init.seeded_by_name`):
        a model sharded over processes (FSDP's DTensors; experts held elsewhere are None) initialises each
        shard where it is, with the values the whole model has in one process."""
        if self.lm_head.weight.is_meta:
            return
        with init.seeded_by_name({id(p): name for name, p in self.named_parameters()}, self.init_seed):
            self._reset_parameters(std)

    def _reset_parameters(self, std: float) -> None:
        residual_std = std / math.sqrt(2 * self.config.num_layers)
        decoder = self.model
        for embedding in (decoder.embed_tokens, getattr(decoder, "embed_positions", None)):
            if embedding is not None:
                init.normal_(embedding.weight, std)
        for layer in decoder.layers:
            layer.self_attn.reset_parameters(std, residual_std)
            layer.ffn.reset_parameters(std, residual_std)
            for norm in (layer.input_layernorm, layer.post_attention_layernorm, layer.attn_res, layer.mlp_res):
                if norm is not None:
                    norm.reset_parameters()
        for norm in (decoder.norm, decoder.final_res):
            if norm is not None:
                norm.reset_parameters()
        if not self.config.tie_word_embeddings:
            init.normal_(self.lm_head.weight, std)

    # -- inference ----------------------------------------------------------------------------------
    def new_cache(self, batch_size: int, max_length: int | None = None) -> Cache:
        """An empty decode cache for `batch_size` sequences (`k3.inference.cache.Cache`): its slot buffers
        allocated once for `max_length` tokens a row (what a compiled decode step runs over), or, without
        it, grown as the rows grow."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"new_cache: `batch_size` must be a positive int, got {batch_size!r}")
        if max_length is not None:
            if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
                raise ValueError(
                    f"new_cache: `max_length` must be a positive int (the most tokens a row will hold), "
                    f"got {max_length!r}"
                )
            positions = self.config.max_position_embeddings
            if positions and max_length > positions:
                raise ValueError(
                    f"new_cache: `max_length` {max_length} is more than the {positions} positions "
                    f"{self.config.name!r} has learned (max_position_embeddings)"
                )
            refuse_if_over_memory(
                f"new_cache: a static cache of {batch_size} row(s) x {max_length:,} tokens for {self.config.name!r}",
                self.cache_bytes(batch_size, max_length),
                "give fewer rows or a smaller `max_length` (k3 generate: fewer prompts or --max-new-tokens)",
            )
        return Cache(self, batch_size, max_length)

    def new_layer_cache(self, index: int, owner: Cache, batch_size: int, slots: int):
        """Layer `index`'s part of `owner`, made by its mixer's kind (`k3.models.kinds`)."""
        kind = self.config.layer_types[index]
        return MIXERS[kind].new_cache(self.model.layers[index].self_attn, owner, batch_size, slots)

    def new_depth_sources(self, batch_size: int) -> torch.Tensor | None:
        """Block AttnRes's depth sources for one token of `batch_size` rows [n, B, 1, d] (float32), which a
        decode step reads and writes in place; None without AttnRes."""
        if self.config.attn_res_block_size is None:
            return None
        blocks = -(-self.config.num_layers // self.config.attn_res_block_size)
        w = self.lm_head.weight
        dtype = torch.promote_types(w.dtype, torch.float32)
        return torch.zeros(blocks + 1, batch_size, 1, self.config.hidden_size, device=w.device, dtype=dtype)

    def cache_bytes(self, batch_size: int, tokens: int) -> int:
        """Bytes the decode cache of `batch_size` sequences of `tokens` tokens holds at this model's dtype
        (`k3.models.kinds.cache_bytes`): what a static cache of that size allocates."""
        for name, value in (("batch_size", batch_size), ("tokens", tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"cache_bytes: `{name}` must be an int >= 0, got {value!r}")
        return cache_bytes(self.config, batch_size, tokens, self.lm_head.weight.element_size())

    def decoding_weights(self) -> list[tuple]:
        """The weight copies decoding reads (k3.layers.joined), from the weights as they are now: for each decoder
        layer, (its mixer's, its FFN's) `fuse_for_decoding()` (the joined projections, a MoE's stacked experts),
        None where the module has none. Give them back as `forward(..., fused=)` (a decode step keeps its own)."""

        def fused(module):
            return module.fuse_for_decoding() if hasattr(module, "fuse_for_decoding") else None

        return [(fused(layer.self_attn), fused(layer.ffn)) for layer in self.model.layers]

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: Cache | None = None,
        *,
        targets: torch.Tensor | None = None,
        reduction: str = "mean",
        logits_to_keep: int = 0,
        prefill_piece: int | None = None,
        fused: list[tuple] | None = None,
    ) -> torch.Tensor:
        """input_ids [B, T] (int64) -> logits [B, T, vocab_size]. With `cache`, continue after the tokens
        it has seen and leave the new state in it (T > 1: chunked prefill, `prefill_piece` tokens at a
        time, default PREFILL_PIECE; T = 1: recurrent decode step). `logits_to_keep` n > 0 returns the
        logits of the last n positions only (transformers' name; 0: all). `fused`: the copies of
        `decoding_weights()`, which decoding through `cache` reads instead of the separate weights (one matmul
        for a layer's projections, a MoE's chosen experts gathered from stacks): what `generate` does.

        With `targets` [B, T] (the next token at each position; IGNORE_INDEX = -100 where none counts),
        return instead the cross-entropy ("mean" over the counted tokens, or "sum"), computed without the
        whole logits (`k3.models.loss.head_cross_entropy`): what training calls, under DDP and FSDP too."""
        self._check_input(input_ids, cache)
        if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise ValueError(f"CausalLM: `logits_to_keep` must be an int >= 0 (0: all), got {logits_to_keep!r}")
        if targets is not None:
            if cache is not None or targets.shape != input_ids.shape:
                raise ValueError(
                    f"CausalLM: `targets` must be [B, T] like `input_ids` {list(input_ids.shape)} "
                    f"and come without a cache, got {list(targets.shape)}"
                    + (" with a cache" if cache is not None else "")
                )
            if targets.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"CausalLM: `targets` must be int64 (or int32) token ids, got {targets.dtype}")
            hidden = self.model(input_ids, None)
            return head_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), self.lm_head.weight, targets, reduction)
        if cache is None:
            hidden = self.model(input_ids, None)
        else:
            hidden = self._through_cache(input_ids, cache, logits_to_keep, self._piece(prefill_piece), fused)
        return self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)

    @staticmethod
    def _piece(prefill_piece: int | None) -> int:
        piece = PREFILL_PIECE if prefill_piece is None else prefill_piece
        if isinstance(piece, bool) or not isinstance(piece, int) or piece < 1:
            raise ValueError(
                f"CausalLM: `prefill_piece` must be a positive int (tokens per prefill forward), got {piece!r}"
            )
        return piece

    def _through_cache(
        self,
        input_ids: torch.Tensor,
        cache: Cache,
        keep: int,
        piece: int,
        fused: list[tuple] | None = None,
    ) -> torch.Tensor:
        """The final hidden states of input_ids [B, T] after the tokens in `cache`, run `piece` tokens at a
        time, each piece after the cache the previous one left: [B, T, d], or with keep > 0 at least the
        last `keep` positions (the hidden states of earlier pieces are dropped as soon as they are not
        needed)."""
        hidden: list[torch.Tensor] = []
        for ids in input_ids.split(piece, dim=1) if input_ids.shape[1] > piece else (input_ids,):
            positions = cache.token_positions(ids.shape[1]) if self.config.max_position_embeddings else None
            hidden.append(self.model(ids, cache.layers, positions, fused=fused))
            cache.advance(ids.shape[1])
            while keep and len(hidden) > 1 and sum(h.shape[1] for h in hidden[1:]) >= keep:
                hidden.pop(0)
        return hidden[0] if len(hidden) == 1 else torch.cat(hidden, dim=1)

    def check_tokens(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None) -> None:
        """A clear error unless `input_ids` are token ids in [0, vocab_size) and `targets` (if given) such ids
        or IGNORE_INDEX. The check a boundary runs (generate, the training step, k3 serve) once per batch:
        it reads the ids' range back from the device, which a forward never does (an id out of range fails
        there in the embedding's or the loss's own index check, without naming it)."""
        outside = self._outside_vocabulary(input_ids)
        if outside:
            raise ValueError(
                f"CausalLM: token ids must be in [0, {self.config.vocab_size}); got ids from "
                f"{outside[0]} to {outside[1]} (does the tokenizer match the model?)"
            )
        if targets is not None:
            outside = self._outside_vocabulary(targets[targets != IGNORE_INDEX])
            if outside:
                raise ValueError(
                    f"CausalLM: `targets` must be token ids in [0, {self.config.vocab_size}) or "
                    f"{IGNORE_INDEX} (not counted); got ids from {outside[0]} to {outside[1]}"
                )

    def _outside_vocabulary(self, ids: torch.Tensor) -> tuple[int, int] | None:
        """(lowest, highest) of `ids` when one is not in [0, vocab_size); None when all are (or none is
        given). One pass, one read-back."""
        if not ids.numel():
            return None
        low, high = torch.stack(torch.aminmax(ids)).tolist()
        return (low, high) if low < 0 or high >= self.config.vocab_size else None

    def _check_input(self, input_ids: torch.Tensor, cache: Cache | None) -> None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            got = list(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"CausalLM: `input_ids` must be a [B, T] tensor of token ids, got {got}")
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"CausalLM: `input_ids` must be int64 (or int32), got {input_ids.dtype}")
        if input_ids.numel() == 0:
            raise ValueError(
                f"CausalLM: `input_ids` {list(input_ids.shape)} holds no tokens; give at least one "
                f"sequence of at least one token ([B, T] with B, T >= 1)"
            )
        if cache is not None:
            if not isinstance(cache, Cache):
                raise ValueError(f"CausalLM: `cache` must come from model.new_cache(), got {type(cache).__name__}")
            if cache.config != self.config:
                raise ValueError(
                    f"CausalLM: this cache was made for another model ({cache.config.name!r}); "
                    f"make one with this model's new_cache()"
                )
            if cache.batch_size != input_ids.shape[0]:
                raise ValueError(
                    f"CausalLM: the cache was made for batch size {cache.batch_size}, `input_ids` "
                    f"has batch size {input_ids.shape[0]}; make a new cache with "
                    f"new_cache({input_ids.shape[0]})"
                )
            cache.check_room(input_ids.shape[1])
        positions = self.config.max_position_embeddings
        seen = 0 if cache is None else cache.length
        if positions and seen + input_ids.shape[1] > positions:
            raise ValueError(
                f"CausalLM: {self.config.name!r} has learned positions for {positions} tokens; "
                f"this call would reach position {seen + input_ids.shape[1]}"
            )

    def generate(
        self,
        input_ids: torch.Tensor | list,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | None = None,
        generator: torch.Generator | None = None,
        compile: bool = False,
    ) -> torch.Tensor | list[torch.Tensor]:
        """Prompt [B, T] -> [B, T + n] with n <= max_new_tokens sampled tokens (temperature 0: greedy).
        Stops early once every sequence has produced `eos_token_id` (later positions repeat it).

        A list of prompts of different lengths (token-id lists or 1-D tensors) decodes as one batch
        without padding (k3.inference.generation) and returns a list: each prompt with its new tokens.
        `compile=True`: decode with a compiled step over a static cache (`k3.inference.decode_step`; the first call
        compiles, later ones reuse what was compiled, also in later runs)."""
        return generation.generate(
            self, input_ids, max_new_tokens, temperature, top_k, top_p, eos_token_id, generator, compile=compile
        )

    def stream(
        self,
        input_ids: torch.Tensor | list,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | None = None,
        generator: torch.Generator | None = None,
        cache: Cache | None = None,
        compile: bool = False,
    ) -> Iterator[torch.Tensor]:
        """As `generate`, yielding each new token [B] as soon as it is sampled. With `cache`, `input_ids`
        [B, T] continue the tokens it has seen (a conversation; see `k3.inference.generation.stream`)."""
        return generation.stream(
            self, input_ids, max_new_tokens, temperature, top_k, top_p, eos_token_id, generator, cache, compile=compile
        )

    def decode_step(
        self,
        cache: Cache,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        compile: bool | str = False,
    ):
        """One token of every row of a static `cache` per call, sampling inside the step, eager or compiled
        whole (`k3.inference.decode_step.DecodeStep`): `step(last_tokens [B]) -> next tokens [B]`."""
        from ..inference.decode_step import DecodeStep

        return DecodeStep(self, cache, temperature, top_k, top_p, generator, compile)

    # -- weights in and out ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        path,
        dtype: torch.dtype | None = None,
        *,
        device=None,
        experts: str | None = None,
        layers=None,
        strict: bool = True,
    ) -> "CausalLM":
        """Load a k3 checkpoint, a Kimi Linear checkpoint (Hub or transformers layout) or Kimi K3's published
        one (sharded, MXFP4 experts) from a directory with config.json and safetensors weights, one tensor
        at a time. `dtype`: the model's dtype; `experts="mxfp4"`: keep the routed experts MXFP4 (decoded
        when they run); `layers`: only these decoder layers (indices); `device="meta"`: no weights at all.
        Every tensor is checked: names and shapes against the model (a size that contradicts config.json
        names the field), integer or bool tensors and NaN or infinity refused, each error one line naming
        the tensor and its file. `strict=False` loads what the values and dtypes checks refuse (cast to the
        model's dtype, NaN and infinity kept) and builds the model with the tensors' sizes where config.json
        says otherwise, with a warning; names and shapes nothing explains are refused either way. See
        `k3.checkpoints.loading`."""
        return loading.load_pretrained(cls, path, dtype, device=device, experts=experts, layers=layers, strict=strict)

    def save_pretrained(self, path) -> None:
        """Write config.json and model.safetensors (k3 layout), never leaving a half-written file."""
        checkpoint.save_pretrained(self, path)

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
