"""One forward over several rows of a slot pool at once, their tokens packed along T: a serving turn's decode
tokens and prompt pieces together (vLLM's one forward a turn: "there's no decoding phase nor prefill phase").

A turn gives each row its tokens: one for a row that decodes, a piece of its prompt for one that prefills.
Packed, they are one input [1, N] in the order of the turn's `Group`s. Every token-wise part of a layer (the
norms, the FFN or the MoE, Block AttnRes's depth mixes, the embeddings and the head) runs once over the N
tokens; each layer's mixer, which reads and writes a row's state, runs once per group, over that group's
rows as a batch [rows, tokens, d] (`PackedLayerCache.mix`):
- the decoding rows: one token each, over the pool's first rows (`Cache.view` with `live` marking the rows
  that decode; the others, free or prefilling, are left unchanged), the tokens scattered to their rows and
  the outputs gathered back;
- prompt pieces of one length: one row through its view, several through their rows by index (`RowsCache`).
Each group's cache gives its tokens their positions and masks, so a row's tokens see its own past only, and
each row computes what it would alone (in float64, to the last place of its own forward's rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache import Cache
from .row_cache import RowsCache


@dataclass
class Group:
    """Rows of one pool that run one mixer call: `cache` (a pool view, a row's view or a `RowsCache`), `count`
    rows with `tokens` tokens each, packed row after row; `picks` [count], for the decoding rows: the rows
    of `cache` they are (the others are not run), None when the group is every row of `cache` in order."""

    cache: Cache
    count: int
    tokens: int
    picks: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.count * self.tokens

    def positions(self) -> torch.Tensor:
        """[size]: the positions of the group's tokens, row after row (before the forward)."""
        if self.picks is not None:
            return self.cache.positions.index_select(0, self.picks)
        return self.cache.token_positions(self.tokens).reshape(-1)

    def advance(self) -> None:
        """After the forward: the rows' positions past their tokens (a pool view's `live` rows only), and a
        `RowsCache`'s states written back into the pool."""
        self.cache.advance(self.tokens)
        if isinstance(self.cache, RowsCache):
            self.cache.commit()


class PackedLayerCache:
    """Layer `layer`'s caches of a packed forward's groups; `mix` runs that layer's mixer group by group."""

    def __init__(self, groups: list[Group], layer: int):
        self.groups, self.layer = groups, layer

    def mix(self, mixer, x: torch.Tensor) -> torch.Tensor:
        """x [1, N, d] (the groups' tokens in order) -> the mixer's output [1, N, d], each group's rows a
        batch over its own cache."""
        out, start = [], 0
        for group in self.groups:
            part = x[0, start : start + group.size]
            cache = group.cache.layers[self.layer]
            if group.picks is not None:  # one token per decoding row, in the pool's rows
                rows = part.new_zeros(group.cache.batch_size, 1, part.shape[-1])
                rows.index_copy_(0, group.picks, part[:, None])
                out.append(mixer(rows, cache=cache)[:, 0].index_select(0, group.picks))
            else:
                out.append(mixer(part.view(group.count, group.tokens, -1), cache=cache).reshape(group.size, -1))
            start += group.size
        return torch.cat(out)[None]


def packed_forward(model, ids: torch.Tensor, groups: list[Group]) -> torch.Tensor:
    """The final hidden states [N, d] of the groups' tokens `ids` [N] (packed in the groups' order), each
    group continuing its cache, which the forward advances (see the module)."""
    for group in groups:
        group.cache.check_room(group.tokens)
    positions = None
    if model.config.max_position_embeddings:
        positions = torch.cat([group.positions() for group in groups])[None]
    caches = [PackedLayerCache(groups, i) for i in range(model.config.num_layers)]
    hidden = model.model(ids[None], caches, positions)[0]
    for group in groups:
        group.advance()
    return hidden
