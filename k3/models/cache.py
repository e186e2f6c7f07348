"""HybridCache: the growing decode state of a whole model (docs/design.md: the caches), one cache per layer of its
mixer kind, updated in place by every forward. See `k3.models.static_cache` for the preallocated one a
compiled decode step runs over.
"""

from __future__ import annotations

import torch

from ..layers.cache import SequenceCache
from .config import ModelConfig
from .kinds import MIXERS


class HybridCache:
    """Decode state of a whole model: per layer the cache of its mixer kind, a KVCache (MHA), LatentCache
    (MLA: c and k_pe only) or RecurrentCache (linear family: conv states and the fixed-size recurrent
    state). Updated in place by every forward; `length` counts the tokens it has seen.

    Sequences of different lengths decode together after `concat` of their own caches: `pad` [B] then
    counts each row's empty leading slots in the KV / latent caches (`length - pad` tokens seen), which
    attention masks and positions skip; the recurrent states never see them."""

    def __init__(self, config: ModelConfig, batch_size: int):
        self.config, self.batch_size, self.length = config, batch_size, 0
        self.pad: torch.Tensor | None = None  # [B] empty leading slots per row; None: every row is full
        self.layers = [MIXERS[kind].new_cache() for kind in config.layer_types]

    static = False  # a growing cache (StaticCache: preallocated)

    def token_positions(self, T: int) -> torch.Tensor:
        """Positions of the next T tokens: [T], or [B, T] less each row's `pad`."""
        device = None if self.pad is None else self.pad.device
        positions = torch.arange(self.length, self.length + T, device=device)
        return positions if self.pad is None else positions - self.pad[:, None]

    def check_room(self, T: int) -> None:
        """A growing cache has room for any number of tokens."""

    def advance(self, T: int) -> None:
        """After a forward of T tokens."""
        self.length += T

    def lengths(self) -> torch.Tensor:
        """[B] tokens each row has seen."""
        full = torch.full((self.batch_size,), self.length, dtype=torch.long)
        return full if self.pad is None else full - self.pad.cpu()

    @classmethod
    def concat(cls, caches: list["HybridCache"]) -> "HybridCache":
        """One cache whose rows are those of `caches` in order (same model; any lengths): how prompts of
        different lengths, each prefilled alone, decode as one batch. A shorter row's KV / latent cache
        is right-aligned behind empty slots (`pad`), which it never attends to."""
        if not caches:
            raise ValueError("HybridCache.concat: `caches` is empty")
        config = caches[0].config
        if any(c.config != config for c in caches):
            raise ValueError("HybridCache.concat: the caches were made for different models")
        if any(c.length == 0 for c in caches):
            raise ValueError("HybridCache.concat: every cache must have seen at least one token (prefill first)")
        out = cls(config, sum(c.batch_size for c in caches))
        out.length = max(c.length for c in caches)
        pad = out.length - torch.cat([c.lengths() for c in caches])
        out.pad = pad if bool(pad.any()) else None
        out.layers = [type(layers[0]).concat(list(layers), out.length) for layers in zip(*(c.layers for c in caches))]
        return out

    def reorder(self, index: torch.Tensor) -> None:
        """Keep rows `index` [B'] of every layer's cache (a selection or permutation; repeats allowed), in place."""
        for layer in self.layers:
            layer.reorder(index)
        if self.pad is not None:
            self.pad = self.pad.index_select(0, index.cpu())
        self.batch_size = index.numel()

    def trim(self) -> int:
        """Drop the leading slots that no row holds a token in (every row's `pad` covers them), in place;
        return how many. After `reorder` drops the longest rows (a finished sequence leaving a batch), the
        rest no longer pay for its length in memory or in attention."""
        if self.pad is None:
            return 0
        slots = int(self.pad.min())
        if slots == 0:
            return 0
        for layer in self.layers:
            if isinstance(layer, SequenceCache):
                layer.trim(slots)
        pad = self.pad - slots
        self.pad = pad if bool(pad.any()) else None
        self.length -= slots
        return slots

    def nbytes(self) -> int:
        """Bytes held by all layers' caches: the tokens seen and the fixed-size states. The KV and latent
        caches keep spare room to grow into, which this does not count (`allocated_bytes` does)."""
        return sum(c.nbytes() for c in self.layers)

    def allocated_bytes(self) -> int:
        """Bytes of all layers' cache buffers, spare capacity included (at most about twice `nbytes`)."""
        return sum(c.allocated_bytes() for c in self.layers)

    def nbytes_by_type(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for kind, c in zip(self.config.layer_types, self.layers):
            out[kind] = out.get(kind, 0) + c.nbytes()
        return out

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.config.name!r}, batch_size={self.batch_size}, length={self.length}, "
            f"nbytes={self.nbytes():,})"
        )
