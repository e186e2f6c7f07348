"""The serving engine: continuous batching over one slot pool, one compiled step per batch size (compiled in
the background), chunked prefill, prefix caching, and admission that never overruns the cache budget.

The engine holds one static cache (`model.new_cache(slots, max_length=N)`, `k3.serve.slots`): a fixed number
of rows, the slots, each with room for N tokens (gpt-fast's static cache; vLLM's state slots for the
recurrent layers). A sequence holds one row from its admission to its end, addressed by index: its prompt is
prefilled into that row, a prefix-cache hit restored into it, it decodes there, and when it ends the row is
free for the next (nothing else moves). One loop, on a thread of its own, owns the model and runs its torch
work with `threads` threads; no other live thread should have run torch on more than one: torch's OpenMP
(libgomp) cuts its workers' spin-wait once the threads it manages outnumber the cores, and every small op of
the loop then waits for its workers to wake (`k3 serve` loads the model on one torch thread). Each turn of it
1. admits waiting sequences, oldest first, while a row is free and one of their prefill pieces fits the
   budget, each given the lowest free row;
2. runs one forward (`k3.serve.prefill`): every running sequence's next token and, under the turn's token
   budget (`max_num_batched_tokens`, the running rows' tokens first; at most `prefill_chunk` prompt tokens,
   0: every admitted prompt whole), a piece of each prefilling prompt, oldest first, packed into one input
   (`k3.inference.packed`: the token-wise layers over every token, each mixer per group of rows) and
   written into the sequences' rows. A long prompt takes several turns, and the running rows decode in
   each of them instead of waiting for the whole prompt (Sarathi; vLLM: "there's no decoding phase nor
   prefill phase"). With the prefix cache (`k3.serve.prefix`) a prompt first resumes from its longest
   cached prefix, and the states at each block boundary it reaches are kept. A turn with no prompt to
   prefill runs the decode step (`k3.inference.decode_step`) over the pool's first b rows and L slots: b
   the smallest batch bucket that holds the highest running row, L the smallest length bucket that holds
   their longest; eager until its compiled one (one graph, made in the background) is ready. Either way the
   rows that do not decode (free, or prefilling) are left as they are (`SlotPool.live`);
3. draws once (`k3.serve.sampler`): the next token of every running row and the first of every sequence
   whose prompt is done, each by its own settings; those join the running rows;
4. drops the sequences that finished (their token limit, their end-of-text token), failed or were
   cancelled (a client that went away, a stop string): their rows are free at once.
A sequence joins once its prompt is prefilled and leaves at the turn it ends (Orca, Yu et al. 2022). Every
row is at its own position, masked past it; no state sees another row's token: each computes what it would alone.
A sequence's length has one record, its row's position on the device; the host's count (`Sequence.held`)
is the scheduler's, which picks the buckets.

A failure is contained where it happens: a sequence whose prompt ids, sampling or `on_token` callback fail
ends alone with "error: ..." (and a line in the log, logger "k3.serve"); only a failure of a turn's shared
forward ends the sequences in it. What could never run is refused before it is queued: `submit` checks a
sequence's settings and token ids against the model (ValueError naming the field), the constructor each
of its arguments.

Memory, counted by k3's own accounting against `cache_memory`: the pool (its slots, fixed at start:
`max_running`, or fewer when N-token rows for all would not fit beside one prefill piece), the transient
memory of a turn's prefill pieces (`prefill_bytes`: attention masks, expanded keys, hidden states; a long
prompt's piece shrunk until it fits), and the prefix cache's blocks, which give way
(least recently used first) when a prefill needs room. What does not fit waits in a bounded queue, past its
bound refused (503).
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import deque

import torch

from ..models.model import PREFILL_PIECE
from .prefill import Prefiller
from .prefix import PrefixCache
from .sampler import draw
from .sequence import Draining, QueueFull, Sequence, check_engine_arguments, prefill_bytes, sequence_bytes
from .slots import SlotPool

log = logging.getLogger("k3.serve")

DEFAULT_MAX_LENGTH = 4096  # tokens a slot holds for a model without learned positions, unless told
PREFILL_CHUNK = 512  # prompt tokens prefilled per engine turn by default (docs/benchmarks.md: k3 bench serve)
PREFIX_BLOCK = 256  # tokens per prefix-cache block when prefill is not chunked
PREFIX_CACHE = True  # k3 serve's default (docs/benchmarks.md: k3 bench serve)


class Engine:
    """Continuous batching for one model over a slot pool (see the module docstring).

    `cache_memory`: the bytes (an int; `k3.serve.parse_bytes('1GiB')` for a size) the pool, the prefilling
    sequences (and one piece's activations) and the prefix cache may take together, at most the device's free
    memory; `max_queue`: how many may wait; `max_running`: the slots, sequences prefilled or decoded at once at
    most (fewer when `cache_memory` does not hold that many rows of `max_length` tokens); `max_length`: the most
    tokens a sequence may have, its prompt and max_tokens together (as vLLM's max_model_len; its cache holds
    one fewer, the last token being sampled, never fed back), at least 2 (default: the model's learned
    positions, else DEFAULT_MAX_LENGTH); `prefill_chunk`: prompt tokens prefilled per turn (0: each prompt
    whole in the turn it is admitted); `compile`: decode with compiled steps, made in the background while
    eager ones serve (True: inductor; a torch.compile backend name; False: eager); `prefix_cache`: keep and
    reuse prompts' states in blocks of `prefix_block` tokens (default: `prefill_chunk`, else PREFIX_BLOCK);
    `max_num_batched_tokens`: the tokens one turn's forward takes at most, the running rows' one each first,
    prompt pieces in what is left (vLLM's name; None: the running rows and `prefill_chunk`); `threads`: the
    torch threads of its loop and its compiler (default: torch's, `torch.get_num_threads()`).
    Each argument is checked here, a ValueError naming it."""

    def __init__(
        self,
        model,
        cache_memory: int,
        max_queue: int = 256,
        max_running: int = 256,
        prefill_chunk: int = PREFILL_CHUNK,
        max_length: int | None = None,
        compile: bool | str = False,
        prefix_cache: bool = False,
        prefix_block: int | None = None,
        max_num_batched_tokens: int | None = None,
        threads: int | None = None,
    ):
        counts = dict(max_queue=max_queue, max_running=max_running, prefill_chunk=prefill_chunk, threads=threads)
        counts.update(max_length=max_length, prefix_block=prefix_block, max_num_batched_tokens=max_num_batched_tokens)
        cache_memory = check_engine_arguments(model, cache_memory, compile, prefix_cache, counts)
        config = model.config
        self.model = model
        self.device = model.lm_head.weight.device
        self.dtype_bytes = model.lm_head.weight.element_size()
        self.max_length = max_length or config.max_position_embeddings or DEFAULT_MAX_LENGTH
        self.cache_memory, self.max_queue, self.prefill_chunk = cache_memory, max_queue, prefill_chunk
        self.max_num_batched_tokens = max_num_batched_tokens
        row = sequence_bytes(config, self.max_length, self.dtype_bytes)
        piece = min(prefill_chunk or PREFILL_PIECE, self.max_length)
        # slots for the rows, beside room to prefill a longest prompt in full pieces, else in pieces of 64
        one_prefill = prefill_bytes(config, piece, self.max_length, self.dtype_bytes)
        slots = (cache_memory - one_prefill) // row
        if slots < 1:
            one_prefill = prefill_bytes(config, min(64, piece), self.max_length, self.dtype_bytes)
            slots = (cache_memory - one_prefill) // row
        self.slots = min(max_running, slots)
        if self.slots < 1:
            raise ValueError(
                f"Engine: `cache_memory` {cache_memory:,} bytes does not hold one row of {self.max_length:,} "
                f"tokens ({row:,} bytes) beside one prefill ({one_prefill:,}): give more memory or a smaller "
                f"`max_length` (k3 serve: --cache-memory, --max-model-len)"
            )
        self.max_running = self.slots
        self.free_rows = list(range(self.slots))  # the pool's rows no sequence holds, lowest first
        self.lent = 0  # the pool's last rows lent to the compiler (`k3.serve.slots`)
        self.threads = threads or torch.get_num_threads()
        self.pool = SlotPool(
            model, self.slots, self.max_length, compile, model.decoding_weights(), self._reserve, self.threads
        )
        self.pool_bytes = self.pool.nbytes
        block = prefix_block or prefill_chunk or PREFIX_BLOCK
        self.prefix = PrefixCache(block) if prefix_cache else None
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []  # admitted, prompt not yet all in their rows
        self.ready: list[Sequence] = []  # prompt all in, first token drawn at this turn's end
        self.running: list[Sequence] = []  # decoding, each in its row
        self.reserved = 0  # the admitted sequences' cache bytes at their longest (what `stats` reports)
        self.peak_running = 0
        self.steps = 0
        self.prefiller = Prefiller(self)
        self.generator = torch.Generator(self.device)  # the draws of the rows without a seed of their own
        self.generator.seed()
        self.lock = threading.Condition()
        self._draining = self._stopped = False
        self._thread: threading.Thread | None = None

    # -- the public side, any thread ---------------------------------------------------------------
    def bytes_for(self, sequence: Sequence) -> int:
        """Cache bytes `sequence` holds at its longest."""
        return sequence_bytes(self.model.config, sequence.total_tokens, self.dtype_bytes)

    @property
    def room(self) -> int:
        """Bytes of the budget not taken by the pool and the prefix cache."""
        held = self.prefix.nbytes if self.prefix is not None else 0
        return self.cache_memory - self.pool_bytes - held

    @property
    def busy(self) -> int:
        """Slots held by sequences: running, prefilling, or waiting for their first token."""
        return len(self.running) + len(self.prefilling) + len(self.ready)

    def _reserve(self, rows: int) -> bool:
        """Lend the pool's last `rows` rows to a compile while no sequence holds them (negative: give back)."""
        with self.lock:
            last = list(range(self.slots - abs(rows), self.slots))
            if rows > 0:
                if self.free_rows[-rows:] != last:
                    return False
                del self.free_rows[-rows:]
            else:
                self.free_rows += last
            self.lent += rows
            return True

    def plan(self, sequence: Sequence, room: int | None = None, smallest: int = 1) -> tuple[int, int]:
        """(prompt tokens per prefill piece, bytes one piece takes): the largest piece, up to the prefill
        chunk (PREFILL_PIECE when prefill is not chunked), halved until its bytes fit `room` (default: the
        budget beside the pool) or it is down to `smallest` tokens."""
        piece = min(self.prefill_chunk or PREFILL_PIECE, len(sequence.prompt))
        if room is None:
            room = self.cache_memory - self.pool_bytes
        while True:
            need = prefill_bytes(self.model.config, piece, len(sequence.prompt), self.dtype_bytes)
            if piece <= smallest or need <= room:
                return piece, need
            piece //= 2

    def submit(self, sequence: Sequence) -> None:
        """Queue a sequence. ValueError: it could never run (a setting or token id out of range, its
        tokens or its prefill past the budget, submitted before); RuntimeError: the engine is not started;
        QueueFull, Draining: not now."""
        if self._thread is None:
            raise RuntimeError("Engine.submit: the engine is not started (call engine.start() first)")
        if not isinstance(sequence, Sequence):
            raise ValueError(f"Engine.submit: expected a Sequence, got {type(sequence).__name__}")
        self._check_new(sequence)
        sequence.check(self.model.config.vocab_size)  # again: its fields may have changed since it was made
        tokens = len(sequence.prompt) + sequence.max_tokens
        if tokens > self.max_length:
            raise ValueError(
                f"the sequence's {len(sequence.prompt)} prompt tokens and max_tokens {sequence.max_tokens} are "
                f"{tokens} tokens, more than the {self.max_length} a sequence may have (--max-model-len): ask "
                f"for fewer tokens"
            )
        piece, transient = self.plan(sequence)
        if transient > self.cache_memory - self.pool_bytes:
            raise ValueError(
                f"the prefill of the sequence's {len(sequence.prompt)} prompt tokens needs {transient:,} "
                f"bytes, more than the {self.cache_memory - self.pool_bytes:,} the server's cache budget "
                f"(--cache-memory) leaves beside its {self.slots} slots: ask for fewer tokens"
            )
        with self.lock:
            if self._draining:
                raise Draining("the server is shutting down")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are waiting already (the queue's bound, --max-queue)")
            self._check_new(sequence)  # again, under the lock: two threads may submit it at once
            sequence.submitted = True
            sequence.reserved = self.bytes_for(sequence)
            sequence.fitting_piece, sequence.prefill_reserved, sequence.piece = piece, transient, piece
            self.waiting.append(sequence)
            self.lock.notify_all()

    @staticmethod
    def _check_new(sequence: Sequence) -> None:
        """A sequence runs once: one submitted before (to this engine or another) or already ended is refused."""
        if sequence.submitted or sequence.finish_reason is not None or sequence.tokens:
            state = sequence.finish_reason or "queued or running"
            raise ValueError(f"Engine.submit: sequence {sequence.id} was submitted before ({state}): make a new one")

    def cancel(self, sequence: Sequence) -> None:
        """Stop a sequence: a waiting one leaves the queue now, a prefilling or running one at the next turn."""
        with self.lock:
            sequence.cancelled = True
            if sequence in self.waiting:
                self.waiting.remove(sequence)
                self.finish(sequence, "cancelled")
            self.lock.notify_all()

    def start(self) -> "Engine":
        """Start the loop on its own thread (once: a stopped engine does not start again)."""
        if self._thread is not None or self._stopped:
            raise RuntimeError("Engine.start: an engine starts once (this one was started or stopped): make a new one")
        self._thread = threading.Thread(target=self._loop, name="k3-engine", daemon=True)
        self._thread.start()
        self.pool.start_compiling()  # with `compile`: the steps, in the background, while eager ones serve
        return self

    def drain(self) -> None:
        """Admit nothing new (submit raises Draining); what is queued or running goes on."""
        with self.lock:
            self._draining = True

    def stop(self, timeout: float | None = None) -> None:
        """Cancel everything queued or running and end the loop."""
        with self.lock:
            self._draining = self._stopped = True
            for sequence in list(self.waiting) + self.prefilling + self.ready + self.running:
                sequence.cancelled = True
            self.lock.notify_all()
        self.pool.stop_compiling(timeout)
        if self._thread is not None:
            self._thread.join(timeout)

    def stats(self) -> dict:
        """running: sequences prefilling or decoding; waiting: queued for admission; slots_free: slots no
        sequence holds; cache_bytes_reserved: what the admitted sequences hold at their longest and one
        prefill piece's activations."""
        with self.lock:
            return {
                "running": self.busy,
                "waiting": len(self.waiting),
                "slots": self.slots,
                "slots_free": self.slots - self.busy,
                "max_length": self.max_length,
                "cache_bytes_reserved": self.reserved + self._prefill_reserve(),
                "cache_memory": self.cache_memory,
                "pool_bytes": self.pool_bytes,
                "peak_running": self.peak_running,
                "steps": self.steps,
                "compiled": bool(self.pool.compile),
                **self.pool.compile_status(),
                "prefix_cache": None if self.prefix is None else self.prefix.summary(),
                "draining": self._draining,
            }

    # -- the loop, its own thread ------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_num_threads(self.threads)
        while True:
            with self.lock:
                while not self._stopped and not self.running and not self.prefilling and not self._admissible():
                    self.lock.wait()
                if self._stopped and not self.running and not self.prefilling:
                    for sequence in list(self.waiting):
                        self.waiting.remove(sequence)
                        self.finish(sequence, "cancelled")
                    return
                if not self._stopped:
                    self._admit()
            try:
                with torch.inference_mode():
                    self._drop_ended()
                    self._turn()
                    self._drop_ended()
            except Exception as e:  # the engine's own failure: fail what ran, keep serving
                log.exception("k3 serve: a turn failed; its %d sequences end with an error", len(self.running))
                self.fail_running(e)

    def _admissible(self) -> bool:
        """Whether the oldest waiting sequence may start now (lock held): a row is free, and one of its
        prefill pieces fits beside what is held (the prefix cache gives way). Its piece shrinks to the room
        there is, down to 64 tokens (or the piece `submit` found fits the whole budget, if smaller): a long
        prompt prefills in smaller pieces rather than wait for a full one's room."""
        if not self.waiting or not self.free_rows:
            return False
        head = self.waiting[0]
        need = max(self._prefill_reserve(), head.prefill_reserved)
        if self.prefix is not None and self.room < need:
            self.prefix.evict(need - self.room)
        room = self.room
        if room < self._prefill_reserve():
            return False
        piece, transient = self.plan(head, room, smallest=min(64, head.fitting_piece))
        if transient > room:
            return False
        head.piece, head.prefill_reserved = piece, transient
        return True

    def _prefill_reserve(self) -> int:
        """The transient bytes prefill may take: its largest piece (pieces run one at a time)."""
        return max((s.prefill_reserved for s in self.prefilling), default=0)

    def _admit(self) -> None:
        """Move the waiting sequences that fit, oldest first, to the prefilling ones, each given the lowest
        free row (lock held)."""
        while self._admissible():
            sequence = self.waiting.popleft()
            self.reserved += sequence.reserved
            sequence.row = self.free_rows.pop(0)
            self.prefilling.append(sequence)
        self.peak_running = max(self.peak_running, self.busy)

    def _turn(self) -> None:
        """The turn's forward (`Prefiller.turn`: the running rows' next tokens and the prompt pieces the budget
        gives, packed into one), then one draw for the running rows and the sequences whose prompt is done
        (their logits kept by the prefill), which then join the running rows: a first token waits for no
        forward after its prompt's last. A forward that fails ends the sequences in it; the others go on."""
        rows = list(self.running)
        logits = self.prefiller.turn(rows)
        rows, parts = (rows, [logits]) if logits is not None else ([], [])
        ready = list(self.ready)
        rows += ready
        parts += [s.first_logits for s in ready]
        if not rows:
            return
        tokens = draw(torch.cat(parts), rows, self.generator, self.finish).tokens
        n = len(rows) - len(ready)
        if n:
            index = torch.tensor([s.row for s in rows[:n]], device=self.device)
            self.pool.feed[index] = torch.tensor(tokens[:n], device=self.device)
            self.steps += 1
            self._emit(rows[:n], tokens[:n])
        for sequence, token in zip(ready, tokens[n:]):
            if sequence.finish_reason is None and not sequence.cancelled:
                self._join(sequence, token)
            else:  # cancelled while it prefilled, or its sampling failed
                self.leave_prefill(sequence, "cancelled")

    def _join(self, sequence: Sequence, token: int) -> None:
        """A prefilled sequence joins the running rows: its row decodes from the next turn, feeding `token`."""
        self.pool.join(sequence.row, token)
        with self.lock:
            self.ready.remove(sequence)
            self.running.append(sequence)
            sequence.first_logits = None
        self._emit([sequence], [token])

    def _free(self, sequence: Sequence) -> None:
        """Its row back to the free ones (decoding no more), its reservation gone (lock held)."""
        self.reserved -= sequence.reserved
        self.pool.leave(sequence.row)
        bisect.insort(self.free_rows, sequence.row)

    def leave_prefill(self, sequence: Sequence, reason: str) -> None:
        """A prefilling (or ready) sequence ends: its row and its reservation go."""
        with self.lock:
            (self.prefilling if sequence in self.prefilling else self.ready).remove(sequence)
            self._free(sequence)
            sequence.first_logits = None
            self.finish(sequence, reason)

    def _emit(self, rows: list[Sequence], tokens: list[int]) -> None:
        for sequence, token in zip(rows, tokens):
            if sequence.finish_reason is not None or sequence.cancelled:
                continue
            if sequence.first_token_at is None:
                sequence.first_token_at = time.perf_counter()
            if token == sequence.eos_token_id:
                self.finish(sequence, "stop")
                continue
            sequence.tokens.append(token)
            try:
                sequence.on_token(token)
            except Exception as e:  # the callback's failure is its sequence's: the others go on
                log.exception("k3 serve: sequence %d's on_token callback raised; it ends", sequence.id)
                self.finish(sequence, f"error: {type(e).__name__}: {e}")
                continue
            if len(sequence.tokens) >= sequence.max_tokens:
                self.finish(sequence, "length")

    def _drop_ended(self) -> None:
        """Free the rows of the sequences that finished, failed or were cancelled."""
        with self.lock:
            for sequence in list(self.running):
                if sequence.cancelled and sequence.finish_reason is None:
                    self.finish(sequence, "cancelled")
                if sequence.finish_reason is not None:
                    self.running.remove(sequence)
                    self._free(sequence)

    def finish(self, sequence: Sequence, reason: str) -> None:
        if sequence.finish_reason is None:
            sequence.finish_reason = reason
            try:
                sequence.on_finish(reason)
            except Exception:  # a callback's failure is its request's, not the engine's
                log.exception("k3 serve: sequence %d's on_finish callback raised", sequence.id)

    def fail_running(self, error: Exception) -> None:
        """The batch's forward failed: end every running sequence (and every one waiting for its first token)
        with the error; the prefilling ones go on."""
        for sequence in list(self.ready):
            self.leave_prefill(sequence, f"error: {type(error).__name__}: {error}")
        with self.lock:
            for sequence in self.running:
                self.finish(sequence, f"error: {type(error).__name__}: {error}")
                self._free(sequence)
            self.running = []
