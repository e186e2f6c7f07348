"""The decode cache: each sequence's state in buffers allocated once and written in place (docs/design.md: the cache).

A `Cache` holds, for `batch_size` rows, every layer's state (`LayerCache`, made by that layer's kind in
`k3.models.kinds`): what grows with the sequence, keys and values or MLA's latents, in buffers of N slots
written at each row's position; and the fixed-size states of the linear family (the recurrent state and
the convolutions' window), overwritten in place. `positions` [B], a tensor, counts the tokens each row has
seen; every layer reads it and the model advances it. Nothing changes shape or address from one token to
the next, so a decode step is one graph for every token (gpt-fast's KV cache and `input_pos`; vLLM's state
slots). Rows sit left-aligned, each at its own position, so prompts of different lengths share a batch
without padding: a forward of T tokens writes row b's at slots positions[b] ... positions[b] + T - 1, and
attention reads the slots up to the longest row's end, each row's masked past its own (`visible`).

`model.new_cache(B, max_length=N)` allocates N slots once and refuses to pass them (a compiled step holds
their addresses; one token reads all N, masked, so its shapes never change). `model.new_cache(B)` grows:
before a forward that would pass its slots, every buffer is replaced by one of twice as many (amortised
O(1) copies a token), and a forward reads only the slots held. Continuous batching's rows joining and
leaving are copies between caches: `Cache.concat` and `reorder`.
"""

from __future__ import annotations

import torch

GROWN_FROM = 64  # the slots a growing cache starts with (then doubled as needed)


class LayerCache:
    """One layer's state in a `Cache`: `sequences` name its [B, N, ...] buffers (each a view of a storage
    tensor whose slot axis may be another, e.g. keys stored head-major [B, H, N, D]); `window` the
    convolutions' [B, 3D, W-1] (or None); `state` the recurrent state [B, ...] (or a tuple of them)."""

    def __init__(
        self,
        owner: "Cache",
        sequences: dict[str, tuple[torch.Tensor, int]] | None = None,
        window: torch.Tensor | None = None,
        state=None,
    ):
        self.owner, self.window, self.recurrent_state = owner, window, state
        self.storage = dict(sequences or {})  # name -> (storage tensor, its slot axis)
        self._views()

    def _views(self) -> None:
        """The [B, N, ...] view of each storage tensor, made once per allocation (not per token)."""
        self.sequences = {name: tensor.movedim(axis, 1) for name, (tensor, axis) in self.storage.items()}

    def __getattr__(self, name: str) -> torch.Tensor:
        sequences = self.__dict__.get("sequences", {})
        if name not in sequences:
            raise AttributeError(name)
        return sequences[name]  # [B, N, ...]

    @property
    def batch_size(self) -> int:
        return self.owner.batch_size

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor allocated for this layer (what a compiled step keeps at fixed addresses)."""
        return [t for t, _ in self.storage.values()] + self.states()

    def append(self, **new: torch.Tensor) -> list[torch.Tensor]:
        """Write each new [B, T, ...] at its row's next T slots, in place; return the buffers' slots that
        attention reads (`Cache.slots_read`), in the order given. Rows all at one position, counted on
        the host, take a plain slice; a compiled step's fixed cache always writes at `positions`."""
        owner, out = self.owner, []
        T = next(iter(new.values())).shape[1]
        # a fixed cache's one-token step reads no host count (one graph whatever the rows' lengths)
        at = owner.length if not (owner.max_length and T == 1) and owner.uniform else None
        read = owner.slots_read(T)
        for name, x in new.items():
            buffer = self.sequences[name]
            if at is not None:
                buffer.narrow(1, at, T).copy_(x)
            elif T == 1:  # an index_put, which inductor writes in place (a scatter it would copy whole)
                slot, value = owner.positions, x[:, 0].to(buffer.dtype)
                if owner.live is not None:  # a row not decoding gets back what its slot holds: unchanged
                    slot = slot.clamp(max=buffer.shape[1] - 1)
                    value = torch.where(_rows_of(owner.live, value), value, buffer[owner.rows, slot])
                buffer.index_put_((owner.rows, slot), value)
            else:
                B = x.shape[0]
                slots = owner.positions[:, None] + torch.arange(T, device=owner.positions.device)
                index = slots.view(B, T, *([1] * (x.dim() - 2))).expand_as(x)
                buffer.scatter_(1, index, x.to(buffer.dtype))
            out.append(buffer[:, :read])
        return out

    def token_positions(self, T: int, device=None) -> torch.Tensor:
        return self.owner.token_positions(T).to(device)

    def visible(self, T: int, S: int, device=None) -> torch.Tensor | None:
        mask = self.owner.visible(T, S)
        return None if mask is None else mask.to(device)

    @property
    def conv_states(self) -> tuple[torch.Tensor, ...] | None:
        """The window's three [B, D, W-1] parts (q, k, v), or None."""
        return None if self.window is None else tuple(self.window.split(self.window.shape[1] // 3, dim=1))

    def conv_window(self) -> torch.Tensor:
        return self.window

    def store(self, recurrent_state, conv_states=None, conv_window: torch.Tensor | None = None) -> None:
        """Copy a forward's new state into the buffers: the recurrent state, and the convolutions' as one
        window [B, 3D, W-1] or as its three parts."""
        live = self.owner.live

        def put(buffer: torch.Tensor, value: torch.Tensor) -> None:  # rows not decoding keep their state
            buffer.copy_(value if live is None else torch.where(_rows_of(live, buffer), value, buffer))

        if conv_window is not None:
            put(self.window, conv_window)
        elif conv_states is not None:
            D = self.window.shape[1] // 3
            for i, part in enumerate(conv_states):
                put(self.window.narrow(1, i * D, D), part)
        pairs = zip(*(s if isinstance(s, tuple) else (s,) for s in (self.recurrent_state, recurrent_state)))
        for buffer, value in pairs:
            put(buffer, value)

    def nbytes(self, held: bool = False) -> int:
        """Bytes of the buffers allocated; `held`: of what the rows hold (their tokens' slots, the states)."""
        total = sum(t.numel() * t.element_size() for t in self.buffers())
        if held:  # a slot buffer counts its bytes per (row, slot) times the tokens the rows hold
            for t, axis in self.storage.values():
                per_slot = t.numel() * t.element_size() // (t.shape[0] * t.shape[axis])
                total += per_slot * sum(self.owner.lengths) - t.numel() * t.element_size()
        return total

    def states(self) -> list[torch.Tensor]:
        """The fixed-size state buffers [B, ...]: the convolutions' window, then the recurrent state(s)."""
        states = self.recurrent_state if isinstance(self.recurrent_state, tuple) else (self.recurrent_state,)
        return [t for t in (self.window, *states) if t is not None]

    def view(self, owner: "Cache", rows: int, slots: int, first: int = 0) -> "LayerCache":
        """This layer's rows first ... first+rows-1 and first `slots` slots, sharing its buffers (`Cache.view`)."""
        span = slice(first, first + rows)
        storage = {name: (t[span].narrow(axis, 0, slots), axis) for name, (t, axis) in self.storage.items()}
        return LayerCache(owner, storage, *self.map_states(lambda t: t[span]))

    def map_states(self, fn) -> tuple:
        """(window, recurrent state) with each tensor replaced by fn(tensor), None where there is none; fn
        called in `states()` order (the window first: `Cache.concat` hands out its joined tensors in turn)."""
        window, state = None if self.window is None else fn(self.window), self.recurrent_state
        state = tuple(fn(t) for t in state) if isinstance(state, tuple) else None if state is None else fn(state)
        return window, state

    def read_tokens(self, row: int, start: int, stop: int) -> list[torch.Tensor]:
        """Copies of row `row`'s slots start ... stop-1 of every slot buffer (a prefix cache's block)."""
        return [t[row].narrow(axis - 1, start, stop - start).clone() for t, axis in self.storage.values()]

    def write_tokens(self, row: int, start: int, parts: list[torch.Tensor]) -> None:
        """Write `read_tokens`' copies back at row `row`'s slots from `start`."""
        for (t, axis), part in zip(self.storage.values(), parts):
            t[row].narrow(axis - 1, start, part.shape[axis - 1]).copy_(part)

    def copy_row(self, row: int, source: "LayerCache", source_row: int, tokens: int) -> None:
        """Row `row` := `source`'s row `source_row` (its first `tokens` slots and its states; rows of one
        cache do not overlap, so `source` may be this layer)."""
        self.write_tokens(row, 0, [t[source_row].narrow(axis - 1, 0, tokens) for t, axis in source.storage.values()])
        for mine, theirs in zip(self.states(), source.states()):
            mine[row].copy_(theirs[source_row])

    def _remake(self, fn) -> None:
        """Every tensor replaced by fn(tensor, its slot axis or None)."""
        self.storage = {name: (fn(t, axis), axis) for name, (t, axis) in self.storage.items()}
        self._views()
        self.window, self.recurrent_state = self.map_states(lambda t: fn(t, None))


class Cache:
    """The decode state of `model` for `batch_size` rows (see the module docstring): `layers[i]` layer i's,
    made by its kind (`k3.models.kinds`); `positions` [B] the tokens each row has seen (on the device),
    `lengths` the same on the host; `sources` Block AttnRes's depth sources for one token, or None.
    `max_length`: slots allocated once (None: a cache that grows)."""

    def __init__(self, model, batch_size: int, max_length: int | None = None):
        self.config, self.batch_size, self.max_length = model.config, batch_size, max_length
        self.capacity = max_length or GROWN_FROM
        self.positions = torch.zeros(batch_size, dtype=torch.long, device=next(model.parameters()).device)
        self.live: torch.Tensor | None = None  # [B] bool: the rows a decode step changes (None: all)
        self.lengths = [0] * batch_size
        self.layers = [model.new_layer_cache(i, self, batch_size, self.capacity) for i in range(self.config.num_layers)]
        self.sources = model.new_depth_sources(batch_size)

    @property
    def lengths(self) -> list[int]:
        """The tokens each row has seen, on the host; setting them sets `length` (the longest row's),
        `uniform` (every row at one position) and `rows` (0 ... B-1 on the device, the rows' index)."""
        return self._lengths

    @lengths.setter
    def lengths(self, lengths: list[int]) -> None:
        self._lengths = list(lengths)
        self.length, self.uniform = max(self._lengths, default=0), len(set(self._lengths)) <= 1
        if getattr(self, "rows", None) is None or len(self.rows) != len(self._lengths):
            self.rows = torch.arange(len(self._lengths), device=self.positions.device)

    def slots_read(self, T: int) -> int:
        """Slots attention reads after writing T tokens: all of a fixed cache's for one token (shapes that never
        change), else up to the longest row's end."""
        return self.capacity if self.max_length and T == 1 else self.length + T

    def token_positions(self, T: int) -> torch.Tensor:
        """[B, T]: the positions of each row's next T tokens."""
        return self.positions[:, None] + torch.arange(T, device=self.positions.device)

    def visible(self, T: int, S: int) -> torch.Tensor | None:
        """[B, 1, T, S]: slot s is visible to query i of row b when s <= positions[b] + i; None when that is
        the plain causal mask of the last T of S slots (every row at the same position, S slots read)."""
        decoding = self.max_length and T == 1  # a compiled step: it must read no host count (one graph)
        if not decoding and S == self.length + T and self.uniform:
            return None
        slots = torch.arange(S, device=self.positions.device)
        return (slots <= self.token_positions(T)[..., None]).unsqueeze(1)

    def check_room(self, T: int) -> None:
        """Make room for T more tokens in the longest row: a growing cache doubles its slots; a fixed one
        refuses with a clear error."""
        needed = self.length + T
        if needed <= self.capacity:
            return
        if self.max_length:
            raise ValueError(
                f"Cache: {T} more token(s) after {self.length} would pass `max_length` {self.max_length}; make "
                f"the cache with a larger max_length (model.new_cache(batch_size, max_length=N))"
            )
        self._resize(max(2 * self.capacity, needed))

    def _resize(self, capacity: int) -> None:
        """Every slot buffer with `capacity` slots, holding what it held (up to the longest row's end)."""
        for layer in self.layers:
            layer._remake(lambda t, axis: _with_slots(t, axis, capacity, self.length))
        self.capacity = capacity

    def advance(self, T: int, positions: bool = True) -> None:
        """After a forward of T tokens: every row has seen T more (`positions`: False when the forward
        advanced the tensor itself, as a decode step does)."""
        if positions:
            self.advance_positions(T)
        self.lengths = [n + T for n in self.lengths]

    def advance_positions(self, T: int) -> None:
        """positions += T for the rows that took the forward's tokens: every row, or the `live` ones."""
        self.positions.add_(T if self.live is None else self.live.long() * T)

    def reset(self) -> None:
        """Empty every row (states and positions zeroed in place), for the next prompts."""
        for layer in self.layers:
            for t in layer.buffers():
                t.zero_()
        self.positions.zero_()
        self.lengths = [0] * self.batch_size

    def reorder(self, index: torch.Tensor) -> None:
        """Keep rows `index` [B'] (a selection or permutation, repeats allowed), in place; a growing cache
        then shrinks to the rows' longest (the slots that rows that left needed are freed)."""
        rows = index.tolist()
        device_index = index.to(self.positions.device)
        for layer in self.layers:
            layer._remake(lambda t, axis: t.index_select(0, device_index))
        self.positions = self.positions.index_select(0, device_index)
        self.lengths, self.batch_size = [self.lengths[i] for i in rows], len(rows)
        self.sources = _sources_for(self.sources, len(rows))
        self.trim()

    def trim(self) -> int:
        """Shrink a growing cache's slots to its longest row (what `reorder` does); the slots freed."""
        before = self.capacity
        if not self.max_length:
            self._resize(max(GROWN_FROM, self.length))
        return before - self.capacity

    @classmethod
    def concat(cls, caches: list["Cache"], max_length: int | None = None) -> "Cache":
        """One cache whose rows are those of `caches` in order (the same model; any lengths): how prompts
        prefilled apart decode as one batch, and how a server's new sequence joins the running ones.
        `max_length`: a fixed cache of that many slots (None: a growing one)."""
        if not caches:
            raise ValueError("Cache.concat: `caches` is empty")
        if any(c.config != caches[0].config for c in caches):
            raise ValueError("Cache.concat: the caches were made for different models")
        out = object.__new__(cls)
        out.config, out.max_length, out.live = caches[0].config, max_length, None
        out.positions = torch.cat([c.positions for c in caches])
        out.lengths = [n for c in caches for n in c.lengths]
        out.batch_size, out.capacity = len(out.lengths), max_length or max(GROWN_FROM, out.length)
        if out.length > out.capacity:
            raise ValueError(f"Cache.concat: rows of {out.length} tokens do not fit max_length {max_length}")
        out.layers = []
        for parts in zip(*(c.layers for c in caches)):  # each layer's tensors at one capacity, rows stacked
            layer = LayerCache(out, parts[0].storage, parts[0].window, parts[0].recurrent_state)
            joined = iter(
                torch.cat(ts) for ts in zip(*(_at_capacity(p, out.capacity, c.length) for p, c in zip(parts, caches)))
            )
            layer._remake(lambda t, axis: next(joined))
            out.layers.append(layer)
        out.sources = _sources_for(caches[0].sources, out.batch_size)
        return out

    def view(self, rows: int, slots: int, first: int = 0) -> "Cache":
        """A fixed cache of this one's `rows` rows from row `first` (default: its first rows) and first
        `slots` slots, sharing its buffers and its positions (a view: what a step through it writes lands
        here; its strides are this cache's); its host `lengths` are the caller's to keep. How a slot pool
        (k3.serve) runs a step over the rows it uses, reading only the slots they fill."""
        if not self.max_length or first < 0 or first + rows > self.batch_size or slots > self.capacity:
            raise ValueError(
                f"Cache.view: rows {first} ... {first + rows - 1} x {slots} slots of a fixed cache of "
                f"{self.batch_size} x {self.capacity} (a fixed cache only)"
            )
        out = object.__new__(type(self))
        out.config, out.max_length, out.capacity, out.batch_size = self.config, slots, slots, rows
        out.positions, out.live = self.positions[first : first + rows], None
        out.lengths = self.lengths[first : first + rows]
        out.layers = [layer.view(out, rows, slots, first) for layer in self.layers]
        out.sources = _sources_for(self.sources, rows)
        return out

    def clear_row(self, row: int) -> None:
        """Empty row `row` for a new sequence: its fixed-size states zeroed and its position 0 (its slots are
        read only up to its position, so they keep what they hold)."""
        for layer in self.layers:
            for t in layer.states():
                t[row].zero_()
        self.positions[row] = 0

    def copy_row(self, row: int, source: "Cache", source_row: int = 0) -> None:
        """Row `row` of this cache := row `source_row` of `source` (the same model; this one or another):
        its tokens' slots, its states, its position. One row's copy, what moving a sequence between the
        rows of a slot pool costs."""
        tokens = source.lengths[source_row]
        if tokens > self.capacity:
            raise ValueError(f"Cache.copy_row: a row of {tokens} tokens does not fit {self.capacity} slots")
        for mine, theirs in zip(self.layers, source.layers):
            mine.copy_row(row, theirs, source_row, tokens)
        self.positions[row] = tokens
        self.lengths = [tokens if i == row else n for i, n in enumerate(self.lengths)]

    def nbytes(self, held: bool = False) -> int:
        """Bytes of every buffer allocated (`held`: of what the rows hold: their tokens and the states)."""
        return sum(layer.nbytes(held) for layer in self.layers)

    def nbytes_by_type(self, held: bool = False) -> dict[str, int]:
        out: dict[str, int] = {}
        for kind, layer in zip(self.config.layer_types, self.layers):
            out[kind] = out.get(kind, 0) + layer.nbytes(held)
        return out

    def __repr__(self) -> str:
        return (
            f"Cache({self.config.name!r}, batch_size={self.batch_size}, longest={self.length}, "
            f"capacity={self.capacity}{', fixed' if self.max_length else ''}, nbytes={self.nbytes():,})"
        )


def _with_slots(t: torch.Tensor, axis: int | None, capacity: int, kept: int) -> torch.Tensor:
    """t with `capacity` slots along `axis`, its first `kept` copied (t itself for a fixed-size state)."""
    if axis is None or t.shape[axis] == capacity:
        return t
    out = t.new_zeros(*t.shape[:axis], capacity, *t.shape[axis + 1 :])
    kept = min(kept, capacity, t.shape[axis])
    out.narrow(axis, 0, kept).copy_(t.narrow(axis, 0, kept))
    return out


def _at_capacity(layer: LayerCache, capacity: int, kept: int) -> list[torch.Tensor]:
    """A layer's tensors (`LayerCache.buffers` order), the slot buffers at `capacity` slots."""
    axes = [axis for _, axis in layer.storage.values()]
    return [_with_slots(t, axes[i] if i < len(axes) else None, capacity, kept) for i, t in enumerate(layer.buffers())]


def _rows_of(live: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`live` [B] shaped to broadcast over `like` [B, ...]."""
    return live.view(-1, *([1] * (like.dim() - 1)))


def _sources_for(sources: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """Block AttnRes's depth sources [n, rows, 1, d] like `sources` (scratch a decode step fills), or None."""
    return None if sources is None else sources.new_zeros(sources.shape[0], rows, *sources.shape[2:])
