"""StaticCache: a whole model's decode state in buffers allocated once, for a decode step that is one graph.

`model.new_cache(batch_size, max_length=N)` preallocates every layer's state: the KV and MLA latent
buffers to N slots ([B, N, ...]), the linear family's conv windows and recurrent states at their fixed
sizes. A forward writes into them in place, at `positions` [B] (a tensor: the tokens each row has seen),
and then advances it; nothing about the cache changes size or address, and no Python number in it changes
from one decode step to the next, so `torch.compile(step, fullgraph=True)` captures the step once and
CUDA graphs can replay it (gpt-fast's KV cache and `input_pos`; transformers' static linear-attention
layers; vLLM's state pool). Attention reads all N slots and masks those after each row's position.

Rows of different lengths sit left-aligned, each at its own position: prefill them apart into a growing
cache and `load` it (what `model.generate(..., compile=True)` does), or run a [B, T] batch into the static
cache directly (every row takes T tokens after its own position).

Host-side, `longest` counts the most tokens a row has seen: the capacity check (a forward that would pass
N raises a clear error rather than writing outside the buffers) and a prefill's slot range read it; the
decode step never does.
"""

from __future__ import annotations

import torch

from ..layers.cache import StaticSequenceCache
from ..runtime import refuse_if_over_memory
from .config import ModelConfig


class StaticCache:
    """Decode state of a model for `batch_size` rows of up to `max_length` tokens, allocated once (see the
    module docstring). `layers[i]` is layer i's static cache; `positions` [B] the tokens each row has seen."""

    static = True
    pad = None  # rows are left-aligned: no empty leading slots

    def __init__(self, model, batch_size: int, max_length: int):
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise ValueError(
                f"new_cache: `max_length` must be a positive int (the most tokens a row will hold), got {max_length!r}"
            )
        positions = model.config.max_position_embeddings
        if positions and max_length > positions:
            raise ValueError(
                f"new_cache: `max_length` {max_length} is more than the {positions} positions "
                f"{model.config.name!r} has learned (max_position_embeddings)"
            )
        weight = model.lm_head.weight
        nbytes = model.cache_bytes(batch_size, max_length)
        refuse_if_over_memory(
            f"new_cache: a static cache of {batch_size} row(s) x {max_length:,} tokens for {model.config.name!r}",
            nbytes,
            "give fewer rows or a smaller `max_length` (k3 generate: fewer prompts or --max-new-tokens)",
        )
        self.config: ModelConfig = model.config
        self.batch_size, self.max_length = batch_size, max_length
        self.positions = torch.zeros(batch_size, dtype=torch.long, device=weight.device)
        self.longest = 0
        self.layers = [layer.self_attn.new_static_cache(self, batch_size, max_length) for layer in model.model.layers]
        self.sources = None  # Block AttnRes: a decode step's depth sources [n, B, 1, d], float32 (DepthSources)
        if self.config.attn_res_block_size is not None:
            blocks = -(-self.config.num_layers // self.config.attn_res_block_size)
            self.sources = torch.zeros(
                blocks + 1,
                batch_size,
                1,
                self.config.hidden_size,
                device=weight.device,
                dtype=torch.promote_types(weight.dtype, torch.float32),
            )

    @property
    def length(self) -> int:
        """Tokens the longest row has seen (as `HybridCache.length`)."""
        return self.longest

    def lengths(self) -> torch.Tensor:
        """[B] tokens each row has seen (on the CPU)."""
        return self.positions.cpu()

    def token_positions(self, T: int) -> torch.Tensor:
        """[B, T]: the positions of the next T tokens of each row."""
        return self.positions.unsqueeze(1) + torch.arange(T, device=self.positions.device)

    def check_room(self, T: int) -> None:
        """A clear error when T more tokens would pass `max_length` in the longest row."""
        if self.longest + T > self.max_length:
            raise ValueError(
                f"StaticCache: {T} more token(s) after {self.longest} would pass `max_length` "
                f"{self.max_length}; make the cache with a larger max_length "
                f"(model.new_cache(batch_size, max_length=N))"
            )

    def advance(self, T: int) -> None:
        """After a forward of T tokens: every row has seen T more (in place: `positions` keeps its address)."""
        self.positions.add_(T)
        self.longest += T

    def reset(self) -> None:
        """Empty every row (zero the states and positions, in place), for the next prompts."""
        for layer in self.layers:
            for t in layer.tensors():
                t.zero_()
        self.positions.zero_()
        self.longest = 0

    @torch.no_grad()
    def load(self, cache) -> "StaticCache":
        """Copy a growing cache's state (`HybridCache`, the same model and batch size, rows of any lengths:
        right-aligned behind `pad` there) into this one, each row left-aligned at its own length."""
        if cache.config != self.config or cache.batch_size != self.batch_size:
            raise ValueError(
                f"StaticCache.load: the cache holds {cache.batch_size} rows of "
                f"{cache.config.name!r}; this static cache is for {self.batch_size} of "
                f"{self.config.name!r}"
            )
        lengths = cache.lengths()
        if cache.length == 0 or int(lengths.max()) > self.max_length:
            raise ValueError(
                f"StaticCache.load: the cache's rows hold {lengths.tolist()} tokens; each must "
                f"hold at least one and at most max_length = {self.max_length}"
            )
        device = self.positions.device
        pad = torch.zeros(self.batch_size, dtype=torch.long) if cache.pad is None else cache.pad.cpu()
        for static, grown in zip(self.layers, cache.layers):
            if isinstance(static, StaticSequenceCache):
                S = grown.length
                # row b's tokens sit at slots pad[b] ... S - 1 there: shift them to 0 ... S - pad[b] - 1
                slots = (torch.arange(S)[None] + pad[:, None]).clamp(max=S - 1).to(device)  # [B, S]
                for name in static.sequence_fields:
                    held = getattr(grown, name)
                    index = slots.view(*slots.shape, *([1] * (held.dim() - 2))).expand_as(held)
                    getattr(static, name)[:, :S].copy_(held.gather(1, index))
            else:
                static.store(grown.recurrent_state, conv_states=grown.conv_states)
        self.positions.copy_(lengths.to(device))
        self.longest = int(lengths.max())
        return self

    def nbytes(self) -> int:
        """Bytes of every buffer (all allocated up front)."""
        return sum(c.allocated_bytes() for c in self.layers)

    allocated_bytes = nbytes

    def nbytes_by_type(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for kind, c in zip(self.config.layer_types, self.layers):
            out[kind] = out.get(kind, 0) + c.allocated_bytes()
        return out

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.config.name!r}, batch_size={self.batch_size}, "
            f"max_length={self.max_length}, longest={self.longest}, nbytes={self.nbytes():,})"
        )
