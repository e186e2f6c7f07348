"""The serving engine's slot pool: one static cache whose rows the sequences hold, each one row from its
admission to its end, and the decode steps over its first rows and slots, one per (batch bucket, length
bucket), compiled or eager.

A step over b rows and L slots is a `DecodeStep` over `cache.view(b, L)`: the same buffers, so nothing is
copied from one turn to the next, and with `compile` one graph each (gpt-fast's static cache; vLLM's
CUDA graphs per batch size). Rows are addressed by index: a sequence keeps the row it was given, and
`live` [slots] (on the device) marks the rows that decode, so that a step over rows 0 ... b-1 changes those
rows only: a free row, or one whose prompt is still prefilling, keeps its state, its slots and its
position (`Cache.live`). `feed` [slots] holds the token each decoding row feeds next. The engine gives the
lowest free row first, so the rows held stay near the pool's first ones.

With `compile`, steps are compiled in the background (`start_compiling`, a thread of its own) while the
pool serves with eager steps over the same buckets: every batch bucket over all slots first, then each other
bucket as a turn first asks for it. A step compiles at its first call, which runs it, so that call runs over
the pool's last rows, lent by the engine while it compiles (`reserve`): no sequence holds them. Then the
step is pointed at the pool's first rows and replaces the eager one: the same graph, as dynamo guards shapes
and strides, not the buffers' addresses. Inductor keeps what it compiled on disk
(`k3.inference.decode_step.compile_cache_dir`), so the next start compiles in far less time.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from ..inference.decode_step import DecodeStep
from ..inference.packed import Group

log = logging.getLogger("k3.serve")

SHORTEST_LENGTH_BUCKET = 256  # the fewest slots a compiled step reads
RETRY_SECONDS = 0.5  # how long the compiler waits when no bucket's scratch fits the budget now


class SlotPool:
    """`slots` rows of `max_length` tokens of `model`'s cache (`cache`, `nbytes`) and the decode steps over
    them (`steps`: eager, made on first use; `compiled`: those compiled in the background, which replace
    them); `compile`: False (eager), True (inductor) or a torch.compile backend name; `fused`: the weight
    copies the steps read (`model.decoding_weights()`); `reserve(rows) -> bool`: the engine lends the pool's last
    `rows` rows to a compile if no sequence holds them (`reserve(-rows)` gives them back; default: lent);
    `threads`: the torch threads the compiler thread runs (and writes its kernels) with (default: torch's)."""

    def __init__(
        self, model, slots: int, max_length: int, compile: bool | str, fused: list[tuple], reserve=None, threads=None
    ):
        self.model, self.slots, self.max_length, self.compile, self.fused = model, slots, max_length, compile, fused
        self.threads = threads or torch.get_num_threads()
        self.cache = model.new_cache(slots, max_length=max_length)
        self.device = self.cache.positions.device
        self.live = torch.zeros(slots, dtype=torch.bool, device=self.device)  # the rows that decode
        self.feed = torch.zeros(slots, dtype=torch.long, device=self.device)  # the token each feeds next
        self.nbytes = self.cache.nbytes()
        self.steps: dict[tuple[int, int], DecodeStep] = {}  # (rows, slots) -> its eager step
        self.compiled: dict[tuple[int, int], DecodeStep] = {}  # (rows, slots) -> its compiled step, once ready
        self.to_compile: list[tuple[int, int]] = []  # the buckets waiting for the compiler, in order
        self.compile_seconds = 0.0
        self.reserve = reserve or (lambda need: True)
        self._wake = threading.Condition()
        self._started = self._stopped = False
        self._compiler: threading.Thread | None = None  # alive while buckets wait (see `_compile_loop`)

    def buckets(self, rows: int, longest: int, compiled: bool | None = None) -> tuple[int, int]:
        """(b, L): the pool rows and slots a step over the pool's first `rows` rows, the longest holding
        `longest` tokens, runs over. Compiled (a graph each, so few): b the smallest batch bucket >= rows
        (`batch_buckets`), L the smallest of max_length / 4^k (k >= 0, at least SHORTEST_LENGTH_BUCKET) above
        `longest`. Eager (nothing to keep; `compiled=False` asks for this): b = rows, L the next multiple of 64."""
        need = longest + 1
        if not (self.compile if compiled is None else compiled):
            return rows, min(self.max_length, -(-need // 64) * 64)
        L = self.max_length
        while L // 4 >= max(need, SHORTEST_LENGTH_BUCKET):
            L //= 4
        return next(b for b in self.batch_buckets() if b >= rows), L

    def step_for(self, rows: int, slots: int) -> DecodeStep:
        """The decode step over the pool's first `rows` rows and `slots` slots: the compiled one once ready,
        else the eager one (made on first use), the bucket queued for the compiler."""
        key = (rows, slots)
        ready = self.compiled.get(key)
        if ready is not None:
            return ready
        if self.compile:
            self._queue(key)
        step = self.steps.get(key)
        if step is None:
            step = self.steps[key] = DecodeStep(self.model, self._view(rows, slots), fused=self.fused, sample=False)
        return step

    def _view(self, rows: int, slots: int, first: int = 0, live: torch.Tensor | None = None):
        """The cache's rows first ... first+rows-1 and first `slots` slots, its `live` mask the pool's rows'
        (or `live`)."""
        view = self.cache.view(rows, slots, first)
        view.live = self.live[first : first + rows] if live is None else live
        return view

    def batch_buckets(self) -> list[int]:
        """The batch sizes a compiled step runs at: 1, 2, 4, then the multiples of 8 (vLLM's capture sizes),
        and the slots."""
        sizes = [b for b in (1, 2, 4, *range(8, self.slots, 8)) if b < self.slots]
        return sizes + [self.slots]

    def start_compiling(self) -> None:
        """Start compiling (with `compile`): every batch bucket over all slots, smallest first, then the
        buckets turns ask for, on a thread of the pool's while any waits."""
        if not self.compile or self._started:
            return
        self._started = True
        for b in self.batch_buckets():
            self._queue((b, self.max_length))

    def stop_compiling(self, timeout: float | None = None) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify_all()
            compiler = self._compiler
        if compiler is not None:
            compiler.join(timeout)

    def _queue(self, key: tuple[int, int]) -> None:
        with self._wake:
            if key not in self.compiled and key not in self.to_compile:
                self.to_compile.append(key)
                self._wake.notify_all()
                if self._started and not self._stopped and self._compiler is None:
                    self._compiler = threading.Thread(target=self._compile_loop, name="k3-compile", daemon=True)
                    self._compiler.start()

    def _compile_loop(self) -> None:
        """The compiler thread: the queued buckets in order, each once its scratch fits the budget; it ends
        when none waits (a thread's torch (OpenMP) workers end with it: while two threads' workers live, every
        op of the engine's loop runs slower, see `k3.serve.engine`), and `_queue` starts another for the next."""
        torch.set_num_threads(self.threads)
        while True:
            with self._wake:
                if self._stopped or not self.to_compile:
                    self._compiler = None
                    return
                queued = list(self.to_compile)
            # the engine's lock, not this one, while its budget is asked (its thread may hold it and wait here)
            key = next((k for k in queued if self.reserve(k[0])), None)
            if key is None:  # no room now: wait for some
                with self._wake:
                    self._wake.wait(RETRY_SECONDS)
                continue
            try:
                self._compile(key)
            except Exception:  # the eager step goes on serving this bucket
                log.exception("k3 serve: compiling the decode step for %d rows x %d slots failed", *key)
            finally:
                self.reserve(-key[0])
                with self._wake:
                    self.to_compile.remove(key)

    def _compile(self, key: tuple[int, int]) -> None:
        """Compile the step for `key` over the pool's last rows, then point it at its first (see the module)."""
        rows, slots = key
        began = time.perf_counter()
        view = self._view(rows, slots)
        every = torch.ones(rows, dtype=torch.bool, device=self.device)
        scratch = self._view(rows, slots, self.slots - rows, every)  # lent: held by no sequence
        step = DecodeStep(self.model, view, compile=self.compile, fused=self.fused, sample=False)
        step.cache = scratch
        with torch.inference_mode():  # as the loop runs it: the step's tensors alike (one graph)
            scratch.positions.zero_()
            scratch.lengths = [slots - 1] + [0] * (rows - 1)
            step(torch.zeros(rows, dtype=torch.long, device=self.device))
        step.cache, step._warm = view, False  # its first call on the pool checks every guard
        took = time.perf_counter() - began
        with self._wake:
            self.compiled[key] = step
            self.compile_seconds += took
        log.info("k3 serve: compiled the decode step for %d rows x %d slots in %.1f s", rows, slots, took)

    def compile_status(self) -> dict:
        """What /health reports: buckets compiled and waiting, seconds spent compiling."""
        with self._wake:
            return {
                "compiled_buckets": len(self.compiled),
                "buckets_to_compile": len(self.to_compile),
                "compile_seconds": round(self.compile_seconds, 3),
            }

    def join(self, row: int, token: int) -> None:
        """Row `row` decodes from the next turn on, feeding `token` first."""
        self.feed[row], self.live[row] = token, True

    def leave(self, row: int) -> None:
        """Row `row` decodes no more (its sequence ended); what it holds stays until a new sequence clears it."""
        self.live[row] = False

    def decoding(self, rows: list[int], lengths: list[int]) -> Group:
        """The decoding `rows` (holding `lengths` tokens) as a packed forward's group (`k3.inference.packed`):
        one token each, over the pool's first rows up to the highest given, the others unchanged (eager: an
        eager step's bucket)."""
        b, L = self.buckets(max(rows) + 1, max(lengths), compiled=False)
        view = self._view(b, L)
        view.lengths = _held(b, rows, lengths)
        return Group(view, len(rows), 1, torch.tensor(rows, device=self.device))

    def decode(self, rows: list[int], lengths: list[int]) -> torch.Tensor:
        """One token for the decoding `rows` (each feeding its `feed` token, `lengths` the tokens each holds):
        their logits [len(rows), vocab], in that order. The step runs over the pool's first rows up to the
        highest given, the rows between that do not decode unchanged."""
        b, L = self.buckets(max(rows) + 1, max(lengths))
        step = self.step_for(b, L)
        step.cache.lengths = _held(b, rows, lengths)
        step(self.feed[:b])
        return step.last_logits[torch.tensor(rows, device=self.device)]


def _held(b: int, rows: list[int], lengths: list[int]) -> list[int]:
    """The tokens each of the pool's first `b` rows holds: `lengths` at `rows`, 0 elsewhere."""
    held = [0] * b
    for row, n in zip(rows, lengths):
        held[row] = n
    return held
