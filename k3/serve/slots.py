"""The serving engine's slot pool: one static cache whose rows the running sequences hold, and the decode
steps over its first rows and slots, one per (batch bucket, length bucket), compiled or eager.

A step over b rows and L slots is a `DecodeStep` over `cache.view(b, L)`: the same buffers, so nothing is
copied from one turn to the next, and with `compile` one graph each (gpt-fast's static cache; vLLM's
CUDA graphs per batch size). The running sequences hold rows 0 ... n-1 (the engine moves the last row into
a freed one); rows n ... b-1 of a bucket are free slots that run at position 0 and whose outputs nobody
reads (a joining row overwrites their state).
"""

from __future__ import annotations

import logging
import time

import torch

from ..inference.decode_step import DecodeStep

log = logging.getLogger("k3.serve")

SHORTEST_LENGTH_BUCKET = 256  # the fewest slots a compiled step reads


class SlotPool:
    """`slots` rows of `max_length` tokens of `model`'s cache (`cache`, `nbytes`) and the decode steps over
    them (`steps`, made on first use, those of every batch size at the full length by `warm_up`);
    `compile`: False (eager), True (inductor) or a torch.compile backend name; `fused`: the weight copies
    the steps read (`model.decoding_weights()`)."""

    def __init__(self, model, slots: int, max_length: int, compile: bool | str, fused: list[tuple]):
        self.model, self.slots, self.max_length, self.compile, self.fused = model, slots, max_length, compile, fused
        self.cache = model.new_cache(slots, max_length=max_length)
        self.device = self.cache.positions.device
        self.nbytes = self.cache.nbytes()
        self.steps: dict[tuple[int, int], DecodeStep] = {}  # (rows, slots) -> its step
        self.compile_seconds = 0.0

    def buckets(self, rows: int, longest: int) -> tuple[int, int]:
        """(b, L): the pool rows and slots a step for `rows` running rows, the longest holding `longest`
        tokens, runs over. Compiled (a graph each, so few): b the smallest power of two >= rows (at most
        the slots), L the smallest of max_length / 4^k (k >= 0, at least SHORTEST_LENGTH_BUCKET) above
        `longest`. Eager (nothing to keep): b = rows, L the next multiple of 64."""
        need = longest + 1
        if not self.compile:
            return rows, min(self.max_length, -(-need // 64) * 64)
        L = self.max_length
        while L // 4 >= max(need, SHORTEST_LENGTH_BUCKET):
            L //= 4
        return min(1 << (rows - 1).bit_length(), self.slots), L

    def step_for(self, rows: int, slots: int) -> DecodeStep:
        """The decode step over the pool's first `rows` rows and `slots` slots, made on first use."""
        step = self.steps.get((rows, slots))
        if step is None:
            view = self.cache.view(rows, slots)
            step = DecodeStep(self.model, view, compile=self.compile, fused=self.fused, sample=False)
            self.steps[(rows, slots)] = step
        return step

    def batch_buckets(self) -> list[int]:
        """The batch sizes a step runs at: 1, 2, 4, ... and the slots."""
        sizes = [1 << i for i in range(self.slots.bit_length()) if 1 << i < self.slots]
        return sizes + [self.slots]

    def warm_up(self) -> None:
        """Compile the step for every batch bucket over all `max_length` slots, in free slots (a joining
        row overwrites what they leave): what `k3 serve` says at start-up; steps over fewer slots compile
        on first use (each logged)."""
        with torch.inference_mode():  # as the loop runs them: the steps' tensors alike (one graph each)
            for b in self.batch_buckets():
                self.cache.lengths = [self.max_length - 1] + [0] * (self.slots - 1)  # the longest bucket
                self.cache.positions.zero_()
                self.run(torch.zeros(b, dtype=torch.long, device=self.device), rows=b, lengths=[0] * b)
        self.cache.positions.zero_()
        self.cache.lengths = [0] * self.slots

    def run(self, last: torch.Tensor, rows: int, lengths: list[int] | None = None) -> torch.Tensor:
        """One token for the pool's first `rows` rows, feeding `last` [rows]: their logits [rows, vocab]
        (`lengths`: the rows' host lengths to give the step, for the warm-up; default the pool's)."""
        pool = self.cache.lengths
        b, L = self.buckets(rows, max(pool[:rows]))
        step = self.step_for(b, L)
        self.cache.positions[rows:b].zero_()  # free slots in the bucket: position 0, their outputs unread
        step.cache.lengths = (pool[:rows] if lengths is None else lengths) + [0] * (b - rows)
        tokens = last if b == rows else torch.cat([last, last.new_zeros(b - rows)])
        began = time.perf_counter()
        first = self.compile and not step._warm
        step(tokens)
        if first:
            took = time.perf_counter() - began
            self.compile_seconds += took
            log.info("k3 serve: compiled the decode step for %d rows x %d slots in %.1f s", b, L, took)
        if lengths is None:
            self.cache.lengths = [n + 1 for n in pool[:rows]] + pool[rows:]
        return step.last_logits[:rows]
