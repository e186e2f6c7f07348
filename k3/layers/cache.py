"""What every layer's decode cache offers, whatever it holds.

A mixer layer keeps its decode state in a small typed object that the caller owns and the layer updates
in place (`KVCache` for softmax attention, `LatentCache` for MLA, `RecurrentCache` for the linear
family). Each names its tensors once, in `tensor_fields`; those that grow by one row per token, [B, S, ...],
are also listed in `sequence_fields` (a recurrent state has none: its size is fixed). Everything else
(`tensors`, `batch_size`, `nbytes`) follows from that.

The growing fields (`SequenceCache`) live in buffers with spare room along the sequence: appending a
token writes one row, and a full buffer is replaced by one of twice the capacity, so a token costs
amortised O(1) copies instead of a copy of the whole cache (what `torch.cat` would do). Reading a field
gives the rows held so far; assigning one adopts the tensor as the field's buffer.

Rows of different lengths (prompts batched together, `concat`) share one slot axis: a shorter row's
first slots hold no token. `SequenceCache.pad` [B] counts them per row; attention masks them out and
positions count from the first real slot, so a row computes exactly what it would alone.

A static cache (`StaticSequenceCache`, made by `CausalLM.new_cache(batch_size, max_length=N)`) holds the
same fields in buffers of N slots allocated once: a forward writes each row's tokens in place at that
row's position (a tensor), so the buffers keep their shapes and addresses and a decode step is one
graph for every token. Both kinds answer the two questions attention asks of a cache the same way:
`token_positions(T)` (where this call's tokens sit in their rows) and `visible(T, S)` (which slots each
query may look at).
"""

from __future__ import annotations

import torch


class LayerCache:
    """Base of the per-layer caches (fields are tensors, tuples of tensors, or None)."""

    tensor_fields: tuple[str, ...] = ()
    sequence_fields: tuple[str, ...] = ()
    static = False  # True: preallocated buffers written in place (a static cache: new_cache(..., max_length=N))

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held, in field order (tuples flattened; empty fields skipped). A growing field
        gives the tokens held, not its buffer's spare rows."""
        return _flatten(getattr(self, name) for name in self.tensor_fields)

    def _stored(self, name: str):
        """Field `name` as stored: for a growing field its whole buffer, spare rows included. Reading it
        makes no tensor op (a view would), so shape-only questions ask this."""
        return getattr(self, name)

    @property
    def batch_size(self) -> int | None:
        """Rows of the cached tensors, or None while the cache is empty."""
        for name in self.tensor_fields:
            value = self._stored(name)
            if isinstance(value, (tuple, list)):
                value = value[0] if value else None
            if value is not None:
                return value.shape[0]
        return None

    def nbytes(self) -> int:
        """Bytes of what the cache holds (for a growing field, the tokens seen: the spare capacity of its
        buffer is not counted; see `allocated_bytes`)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def allocated_bytes(self) -> int:
        """Bytes of the buffers behind the fields, spare capacity included (>= `nbytes`)."""
        return sum(t.numel() * t.element_size() for t in _flatten(self._stored(n) for n in self.tensor_fields))

    def reorder(self, index: torch.Tensor) -> None:
        """Keep rows `index` [B'] (a selection or permutation of the batch, repeats allowed), in place."""
        for name in self.tensor_fields:
            setattr(self, name, _map(lambda t: t.index_select(0, index.to(t.device)), getattr(self, name)))

    @classmethod
    def concat(cls, caches: list["LayerCache"], slots: int) -> "LayerCache":
        """One cache holding the rows of `caches` one after the other. A fixed-size state is stacked as
        it is (`slots`, the common length of the growing fields, matters to `SequenceCache` only)."""
        out = cls()
        for name in cls.tensor_fields:
            values = [getattr(c, name) for c in caches]
            setattr(out, name, None if values[0] is None else _map_many(lambda *ts: torch.cat(ts), values))
        return out


def _flatten(values) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (tuple, list)):
            out.extend(value)
    return out


def _map(fn, value):
    """fn applied to a tensor field's tensor(s): a tensor, a tuple of tensors, or None."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    return tuple(fn(v) for v in value) if isinstance(value, (tuple, list)) else value


def _map_many(fn, values: list):
    """fn applied across the same field of several caches (tuples position by position)."""
    if isinstance(values[0], torch.Tensor):
        return fn(*values)
    return tuple(fn(*parts) for parts in zip(*values))


class SequenceField:
    """A cache field [B, S, ...] that grows along S (dim 1), declared on a `SequenceCache` subclass.

    Stored as a buffer [B, capacity, ...] whose first S rows are held. Reading the attribute gives those
    rows (the buffer itself when it is full, else a view); assigning a tensor [B, S, ...] adopts it as
    the buffer, full (what `fill_cache` and beam search's row reordering do); None empties the field."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, cache, owner=None):
        if cache is None:
            return self
        buffer, held = cache._rows.get(self.name, (None, 0))
        if buffer is None or held == buffer.shape[1]:
            return buffer
        return buffer[:, :held]

    def __set__(self, cache, value: torch.Tensor | None) -> None:
        cache._rows[self.name] = (value, 0 if value is None else value.shape[1])


class SequenceCache(LayerCache):
    """A cache whose `sequence_fields` are `SequenceField`s: [B, S, ...] tensors that grow by `append`."""

    def __init__(self, **fields: torch.Tensor | None):
        self._rows: dict[str, tuple[torch.Tensor | None, int]] = {}  # name -> (buffer, rows held)
        self.pad: torch.Tensor | None = None  # [B] leading slots without a token, per row (None: all full)
        for name in self.sequence_fields:
            setattr(self, name, fields.pop(name, None))
        if fields:
            raise TypeError(f"{type(self).__name__}: unknown fields {sorted(fields)}; it has {self.sequence_fields}")

    def _stored(self, name: str):
        return self._rows[name][0] if name in self.sequence_fields else getattr(self, name)

    @property
    def length(self) -> int:
        """Tokens held (of the first field; every field holds as many once a forward is done)."""
        return self._rows[self.sequence_fields[0]][1]

    @property
    def capacity(self) -> int:
        """Tokens the first field's buffer has room for before it must grow."""
        buffer = self._rows[self.sequence_fields[0]][0]
        return 0 if buffer is None else buffer.shape[1]

    def append(self, **new: torch.Tensor) -> list[torch.Tensor]:
        """Append new[name] [B, T, ...] to each named field; return the fields' held rows [B, S + T, ...]
        in the order given.

        A buffer without room for T more rows is replaced by one with max(2 * capacity, S + T) rows
        (amortised O(T) per append). While autograd records (a gradient could flow through the new
        rows), the field is concatenated instead, so that no tensor a backward pass needs is overwritten."""
        out = []
        for name, x in new.items():
            buffer, held = self._rows[name]
            total = held + x.shape[1]
            if buffer is None or (torch.is_grad_enabled() and (x.requires_grad or buffer.requires_grad)):
                buffer = x if buffer is None else torch.cat([buffer[:, :held], x], dim=1)
            else:
                if total > buffer.shape[1] or not _writable(buffer, x):
                    buffer = _regrown(buffer, held, max(2 * buffer.shape[1], total), x)
                buffer[:, held:total] = x
            self._rows[name] = (buffer, total)
            out.append(buffer if total == buffer.shape[1] else buffer[:, :total])
        return out

    def token_positions(self, T: int, device=None) -> torch.Tensor:
        """Positions of the next T tokens in their rows: [T] (length ... length + T - 1), or [B, T]
        less each row's `pad`. Asked before `append`."""
        positions = torch.arange(self.length, self.length + T, device=device)
        return positions if self.pad is None else positions - self.pad.to(device)[:, None]

    def visible(self, T: int, S: int, device=None) -> torch.Tensor | None:
        """Which of the S slots held after `append` each of the last T queries may attend to
        (`k3.ops.attention.causal_mask` with `pad`; None when nothing is masked)."""
        from ..ops.attention import causal_mask

        return causal_mask(T, S, self.pad, device)

    def reorder(self, index: torch.Tensor) -> None:
        super().reorder(index)
        if self.pad is not None:
            self.pad = self.pad.index_select(0, index.to(self.pad.device))

    def trim(self, slots: int) -> None:
        """Drop the first `slots` slots of every row, slots in which no row holds a token (each `pad` >=
        slots): what is left of a batch after its longest rows were dropped (`reorder`)."""
        if slots <= 0:
            return
        if self.pad is None or bool((self.pad < slots).any()):
            raise ValueError(
                f"{type(self).__name__}.trim: {slots} leading slots hold tokens of some row "
                f"(pad {None if self.pad is None else self.pad.tolist()})"
            )
        for name in self.sequence_fields:
            held = getattr(self, name)
            setattr(self, name, None if held is None else held[:, slots:])
        pad = self.pad - slots
        self.pad = pad if bool(pad.any()) else None

    @classmethod
    def concat(cls, caches: list["SequenceCache"], slots: int) -> "SequenceCache":
        """The rows of `caches` one after the other, each field's rows right-aligned on `slots` slots
        (>= every cache's length): a cache with fewer slots gets empty leading ones (zeros), counted in
        `pad` and never attended to."""
        out = cls()
        for name in cls.sequence_fields:
            parts = []
            for c in caches:
                held = getattr(c, name)
                if held.shape[1] < slots:
                    held = torch.cat([held.new_zeros(held.shape[0], slots - held.shape[1], *held.shape[2:]), held], 1)
                parts.append(held)
            setattr(out, name, torch.cat(parts))
        pads = [
            torch.full((c.batch_size,), slots - c.length, dtype=torch.long) + (0 if c.pad is None else c.pad.cpu())
            for c in caches
        ]
        pad = torch.cat(pads)
        out.pad = pad.to(out._stored(cls.sequence_fields[0]).device) if bool(pad.any()) else None
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}(batch_size={self.batch_size}, length={self.length}, capacity={self.capacity})"


def _writable(buffer: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether x's rows can be written into `buffer` in place: same dtype and device, and not an
    inference tensor outside inference mode (torch forbids writing into one there)."""
    return (
        buffer.dtype == x.dtype
        and buffer.device == x.device
        and (torch.is_inference_mode_enabled() or not buffer.is_inference())
    )


def _regrown(buffer: torch.Tensor, held: int, capacity: int, x: torch.Tensor) -> torch.Tensor:
    """A new buffer [B, capacity, ...] for rows like x's, holding buffer's first `held` rows."""
    grown = x.new_empty(x.shape[0], capacity, *x.shape[2:])
    grown[:, :held] = buffer[:, :held]
    return grown


class StaticSequenceCache(LayerCache):
    """A cache whose `sequence_fields` are buffers [B, N, ...] of N slots (max_length) allocated once,
    written in place at the rows' positions (gpt-fast's KV cache; transformers' StaticCache).

    `owner` is the model-wide static cache (`k3.models.static_cache.StaticCache`): its `positions` [B]
    (a tensor) counts the tokens each row has seen, which every layer reads and the owner advances after
    the forward. A forward of T tokens writes row b's at slots positions[b] ... positions[b] + T - 1, so
    rows of different lengths sit left-aligned, without padding. One token (decode) returns the whole
    buffers, masked past each row's position (`visible`): shapes that never change, no Python int that
    changes per token. More tokens (prefill) return the slots up to the longest row's end (a host-side
    count the owner keeps), so a prompt does not pay for the empty slots after it."""

    pad = None  # no empty leading slots: rows are left-aligned
    static = True

    def __init__(self, owner, **buffers: torch.Tensor):
        self.owner = owner
        for name in self.sequence_fields:
            setattr(self, name, buffers.pop(name))
        if buffers:
            raise TypeError(f"{type(self).__name__}: unknown fields {sorted(buffers)}; it has {self.sequence_fields}")

    @property
    def length(self) -> int:
        """Tokens the longest row has seen (host-side; not read by a decode step)."""
        return self.owner.longest

    @property
    def capacity(self) -> int:
        return self._stored(self.sequence_fields[0]).shape[1]

    def _slots(self, T: int) -> torch.Tensor:
        """[B, T]: the slot of each of this call's tokens in its row."""
        positions = self.owner.positions
        return positions.unsqueeze(1) + torch.arange(T, device=positions.device)

    def append(self, **new: torch.Tensor) -> list[torch.Tensor]:
        """Write each new tensor (`[B, T, ...]`) at its row's next T slots, in place; return the buffers
        (T = 1: whole, `[B, N, ...]`; T > 1: the first longest + T slots), in the order given."""
        out = []
        for name, x in new.items():
            buffer = getattr(self, name)
            B, T = x.shape[:2]
            if T == 1:  # an index_put, which inductor writes in place (a scatter it would copy whole)
                rows = torch.arange(B, device=buffer.device)
                buffer.index_put_((rows, self.owner.positions), x[:, 0].to(buffer.dtype))
                out.append(buffer)
                continue
            index = self._slots(T).view(B, T, *([1] * (x.dim() - 2))).expand_as(x)
            buffer.scatter_(1, index, x.to(buffer.dtype))
            out.append(buffer[:, : self.owner.longest + T])
        return out

    def buffers(self) -> list[torch.Tensor]:
        """The tensors allocated for this cache (what the fields are, or are views of)."""
        return [getattr(self, name) for name in self.sequence_fields]

    def token_positions(self, T: int, device=None) -> torch.Tensor:
        """[B, T]: positions of the next T tokens in their rows (each row's own count)."""
        return self._slots(T).to(device)

    def visible(self, T: int, S: int, device=None) -> torch.Tensor:
        """[B, 1, T, S]: slot s is visible to query i of row b when s <= positions[b] + i (its own token
        and the row's earlier ones; the slots after hold nothing yet, or another turn's leftovers)."""
        slots = torch.arange(S, device=self.owner.positions.device)
        return (slots <= self._slots(T).unsqueeze(-1)).unsqueeze(1).to(device)

    def nbytes(self) -> int:
        """Bytes of the buffers (all N slots: they are allocated whatever the rows hold)."""
        return self.allocated_bytes()

    def reorder(self, index: torch.Tensor) -> None:
        raise NotImplementedError(
            f"{type(self).__name__}: a static cache keeps its rows in place; reorder a "
            f"growing cache (model.new_cache(batch_size) without max_length)"
        )

    @classmethod
    def concat(cls, caches, slots):
        raise NotImplementedError(
            f"{cls.__name__}: static caches are not joined; prefill the rows into one "
            f"(k3.models.static_cache.StaticCache.load)"
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(batch_size={self.batch_size}, capacity={self.capacity})"
