"""A fixed cache's rows addressed by index (`RowsCache`): how a slot pool runs one forward over the rows of
several sequences that are not next to each other, in place, with nothing copied in or out but what the
forward reads.

Row b of a `RowsCache` is row `index[b]` of the pool. A forward of T tokens writes row b's new entries at
the pool's slots positions[b] ... positions[b] + T - 1 of row index[b] (an `index_put`), and attention reads
those rows' slots up to the longest row's end (gathered: what the forward reads anyway). The fixed-size
states (the recurrent state, the convolutions' window) and the positions are read into copies when the
`RowsCache` is made, advanced there by the forward, and written back into the pool's rows by `commit()`, so
a forward that fails half-way leaves the pool's states as they were (the slots it wrote lie past every
row's position, where no one reads).
"""

from __future__ import annotations

import torch

from .cache import Cache, LayerCache, _sources_for


class RowsLayerCache(LayerCache):
    """One layer of a `RowsCache`: the pool layer's slot buffers, written and read by row index; copies of
    its states for the rows."""

    def __init__(self, owner: "RowsCache", home: LayerCache):
        super().__init__(owner, home.storage, *home.map_states(lambda t: t.index_select(0, owner.index)))
        self.home = home

    def append(self, **new: torch.Tensor) -> list[torch.Tensor]:
        owner, out = self.owner, []
        T = next(iter(new.values())).shape[1]
        slots = owner.token_positions(T)  # [B, T]
        rows = owner.index[:, None].expand_as(slots)
        read = owner.length + T
        for name, x in new.items():
            buffer = self.sequences[name]  # the pool's [rows, N, ...]
            buffer.index_put_((rows, slots), x.to(buffer.dtype))
            out.append(buffer[:, :read].index_select(0, owner.index))
        return out

    def commit(self) -> None:
        """Write the rows' states back into the pool's rows."""
        for home, mine in zip(self.home.states(), self.states()):
            home.index_copy_(0, self.owner.index, mine)


class RowsCache(Cache):
    """Rows `rows` (a list of distinct row indices) of the fixed cache `pool`, holding `lengths` tokens each
    (the caller's count, equal to the pool's positions): see the module docstring. `commit()` after the
    forward writes the states and positions back."""

    def __init__(self, pool: Cache, rows: list[int], lengths: list[int]):
        if not pool.max_length or len(set(rows)) != len(rows) or len(rows) != len(lengths):
            raise ValueError(f"RowsCache: distinct rows of a fixed cache, a length each; got rows {rows}, {lengths}")
        self.config, self.pool, self.batch_size = pool.config, pool, len(rows)
        self.max_length = self.capacity = pool.capacity
        self.index = torch.tensor(rows, device=pool.positions.device)
        self.positions, self.live = pool.positions.index_select(0, self.index), None
        self.lengths = lengths
        self.layers = [RowsLayerCache(self, layer) for layer in pool.layers]
        self.sources = _sources_for(pool.sources, len(rows))

    def slots_read(self, T: int) -> int:
        return self.length + T  # the rows' slots up to the longest's end, one token or more

    def commit(self) -> None:
        """The forward's states and positions into the pool's rows."""
        for layer in self.layers:
            layer.commit()
        self.pool.positions.index_copy_(0, self.index, self.positions)
