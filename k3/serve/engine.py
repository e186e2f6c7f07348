"""The serving engine: continuous batching over a slot pool, one compiled step per batch size (compiled in
the background), chunked prefill, prefix caching, and admission that never overruns the cache budget.

The engine holds one static cache (`model.new_cache(slots, max_length=N)`): a fixed number of rows, the
slots, each with room for N tokens (gpt-fast's static cache; vLLM's state slots for the recurrent layers).
One loop, on a thread of its own, owns the model. Each turn of it
1. admits waiting sequences, oldest first, while a slot is free and what their prefill holds fits the
   budget;
2. decodes every running sequence, one token each, with the decode step (`k3.inference.decode_step`) over
   the pool's first b rows and first L slots: b the smallest batch bucket (1, 2, 4, ... the slots) that
   holds the running rows, L the smallest length bucket that holds their longest: one step each, eager
   until its compiled one (`compile`, one graph, made in the background: `k3.serve.slots`) is ready; the
   rows past the running ones are free slots whose state nobody reads;
3. prefills up to `prefill_chunk` prompt tokens (chunked prefill; 0: every admitted prompt whole), oldest
   sequence first, each sequence in a cache of its own sized to its prompt: a long prompt takes several
   turns, and the running rows decode between its pieces instead of waiting for the whole prompt
   (Sarathi; vLLM). With the prefix cache (`k3.serve.prefix`) a prompt first resumes from its longest
   cached prefix, and the states at each block boundary it reaches are kept. Pieces of one length from
   several sequences run as one forward (`k3.serve.prefill`). Then one sample (`k3.serve.sampler`) draws
   the next token of every running row and the first of every sequence whose prompt is done, each by its
   own settings; those join the running rows, their row copied into the pool's next slot;
4. drops the sequences that finished (their token limit, their end-of-text token), failed or were
   cancelled (a client that went away, a stop string): the last running row moves into the freed slot
   (one row's copy), so the running rows stay the pool's first ones and nothing else moves.
A sequence joins once its prompt is prefilled and leaves at the turn it ends (Orca, Yu et al. 2022). Every
row is at its own position, masked past it; no state sees another row's token: each computes what it would alone.

A failure is contained where it happens: a sequence whose prefill, sampling or `on_token` callback raises
ends alone with "error: ..." (and a line in the log, logger "k3.serve"), and a prefill batch whose forward
fails runs its pieces again one by one; only a failure of the shared decode forward ends every running
sequence. What could never run is refused before it is queued: `submit` checks a sequence's settings and
token ids against the model (ValueError naming the field), the constructor each of its arguments.

Memory, counted by k3's own accounting against `cache_memory`: the pool (its slots, fixed at start:
`max_running`, or fewer when N-token rows for all would not fit beside one prefill), the caches of the
sequences prefilling and the transient memory of one prefill piece (`prefill_bytes`: attention masks,
expanded keys, hidden states; pieces run one at a time, a long prompt's shrunk until it fits), and the
prefix cache's blocks, which give way (least recently used first) when a prefill needs room, and the scratch
cache a step compiles over. What does not fit waits in a bounded queue, past its bound refused (503).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import torch

from ..models.model import PREFILL_PIECE
from .prefill import Prefill
from .prefix import PrefixCache
from .sampler import draw
from .sequence import Draining, QueueFull, Sequence, check_engine_arguments, prefill_bytes, sequence_bytes
from .slots import SlotPool

log = logging.getLogger("k3.serve")

DEFAULT_MAX_LENGTH = 4096  # tokens a slot holds for a model without learned positions, unless told
PREFILL_CHUNK = 512  # prompt tokens prefilled per engine turn by default (docs/benchmarks.md: k3 bench serve)
PREFIX_BLOCK = 256  # tokens per prefix-cache block when prefill is not chunked
PREFIX_CACHE = True  # k3 serve's default (docs/benchmarks.md: k3 bench serve)


class Engine(Prefill):
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
    reuse prompts' states in blocks of `prefix_block` tokens (default: `prefill_chunk`, else PREFIX_BLOCK).
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
    ):
        counts = dict(max_queue=max_queue, max_running=max_running, prefill_chunk=prefill_chunk)
        counts.update(max_length=max_length, prefix_block=prefix_block)
        cache_memory = check_engine_arguments(model, cache_memory, compile, prefix_cache, counts)
        config = model.config
        self.model = model
        self.device = model.lm_head.weight.device
        self.dtype_bytes = model.lm_head.weight.element_size()
        self.max_length = max_length or config.max_position_embeddings or DEFAULT_MAX_LENGTH
        self.cache_memory, self.max_queue, self.prefill_chunk = cache_memory, max_queue, prefill_chunk
        row = sequence_bytes(config, self.max_length, self.dtype_bytes)
        piece = min(prefill_chunk or PREFILL_PIECE, self.max_length)
        # slots for the rows, beside room to prefill a longest prompt in full pieces, else in pieces of 64
        one_prefill = row + prefill_bytes(config, piece, self.max_length, self.dtype_bytes)
        slots = (cache_memory - one_prefill) // row
        if slots < 1:
            one_prefill = row + prefill_bytes(config, min(64, piece), self.max_length, self.dtype_bytes)
            slots = (cache_memory - one_prefill) // row
        self.slots = min(max_running, slots)
        if self.slots < 1:
            raise ValueError(
                f"Engine: `cache_memory` {cache_memory:,} bytes does not hold one row of {self.max_length:,} "
                f"tokens ({row:,} bytes) beside one prefill ({one_prefill:,}): give more memory or a smaller "
                f"`max_length` (k3 serve: --cache-memory, --max-model-len)"
            )
        self.max_running = self.slots
        self.lent = 0  # the pool's last rows lent to the compiler (`k3.serve.slots`)
        self.pool = SlotPool(model, self.slots, self.max_length, compile, model.decoding_weights(), self._reserve)
        self.pool_bytes = self.pool.nbytes
        block = prefix_block or prefill_chunk or PREFIX_BLOCK
        self.prefix = PrefixCache(block) if prefix_cache else None
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []  # admitted, prompt not yet all in their own caches
        self.ready: list[Sequence] = []  # prompt all in, first token sampled at this turn's end
        self.running: list[Sequence] = []  # running[i] decodes in the pool's row i
        self.reserved = 0  # the admitted sequences' cache bytes at their longest (what `stats` reports)
        self.prefill_held = 0  # the prefilling sequences' own caches
        self.peak_running = 0
        self.steps = 0
        self._last: torch.Tensor | None = None  # [running] the token each running row feeds next
        self.generator = torch.Generator(self.device)  # the draws of the rows without a seed of their own
        self.generator.seed()
        self._lock = threading.Condition()
        self._draining = self._stopped = False
        self._thread: threading.Thread | None = None

    # -- the public side, any thread ---------------------------------------------------------------
    def bytes_for(self, sequence: Sequence) -> int:
        """Cache bytes `sequence` holds at its longest."""
        return sequence_bytes(self.model.config, sequence.total_tokens, self.dtype_bytes)

    @property
    def room(self) -> int:
        """Bytes of the budget not taken by the pool, the prefilling sequences' caches and the prefix cache."""
        held = self.prefix.nbytes if self.prefix is not None else 0
        return self.cache_memory - self.pool_bytes - self.prefill_held - held

    @property
    def busy(self) -> int:
        """Slots held by sequences: running, prefilling, or waiting for their first token."""
        return len(self.running) + len(self.prefilling) + len(self.ready)

    def _reserve(self, rows: int) -> bool:
        """Lend the pool's last `rows` rows to a compile while no sequence holds them (negative: give back)."""
        with self._lock:
            if rows > 0 and self.busy + self.lent + rows > self.slots:
                return False
            self.lent += rows
            return True

    def plan(self, sequence: Sequence, room: int | None = None, smallest: int = 1) -> tuple[int, int]:
        """(prompt tokens per prefill piece, bytes one piece takes): the largest piece, up to the prefill
        chunk (PREFILL_PIECE when prefill is not chunked), halved until its bytes fit `room` (default: the
        budget beside the pool and the sequence's prefill cache) or it is down to `smallest` tokens."""
        piece = min(self.prefill_chunk or PREFILL_PIECE, len(sequence.prompt))
        if room is None:
            room = self.cache_memory - self.pool_bytes - self._prompt_bytes(sequence)
        while True:
            need = prefill_bytes(self.model.config, piece, len(sequence.prompt), self.dtype_bytes)
            if piece <= smallest or need <= room:
                return piece, need
            piece //= 2

    def _prompt_bytes(self, sequence: Sequence) -> int:
        return sequence_bytes(self.model.config, len(sequence.prompt), self.dtype_bytes)

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
        prompt = self._prompt_bytes(sequence)
        piece, transient = self.plan(sequence)
        if prompt + transient > self.cache_memory - self.pool_bytes:
            raise ValueError(
                f"the prefill of the sequence's {len(sequence.prompt)} prompt tokens needs {prompt + transient:,} "
                f"bytes, more than the {self.cache_memory - self.pool_bytes:,} the server's cache budget "
                f"(--cache-memory) leaves beside its {self.slots} slots: ask for fewer tokens"
            )
        with self._lock:
            if self._draining:
                raise Draining("the server is shutting down")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are waiting already (the queue's bound, --max-queue)")
            self._check_new(sequence)  # again, under the lock: two threads may submit it at once
            sequence.submitted = True
            sequence.reserved, sequence.prompt_bytes = self.bytes_for(sequence), prompt
            sequence.fitting_piece, sequence.prefill_reserved, sequence.piece = piece, transient, piece
            self.waiting.append(sequence)
            self._lock.notify_all()

    @staticmethod
    def _check_new(sequence: Sequence) -> None:
        """A sequence runs once: one submitted before (to this engine or another) or already ended is refused."""
        if sequence.submitted or sequence.finish_reason is not None or sequence.tokens:
            state = sequence.finish_reason or "queued or running"
            raise ValueError(f"Engine.submit: sequence {sequence.id} was submitted before ({state}): make a new one")

    def cancel(self, sequence: Sequence) -> None:
        """Stop a sequence: a waiting one leaves the queue now, a prefilling or running one at the next turn."""
        with self._lock:
            sequence.cancelled = True
            if sequence in self.waiting:
                self.waiting.remove(sequence)
                self._finish(sequence, "cancelled")
            self._lock.notify_all()

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
        with self._lock:
            self._draining = True

    def stop(self, timeout: float | None = None) -> None:
        """Cancel everything queued or running and end the loop."""
        with self._lock:
            self._draining = self._stopped = True
            for sequence in list(self.waiting) + self.prefilling + self.ready + self.running:
                sequence.cancelled = True
            self._lock.notify_all()
        self.pool.stop_compiling(timeout)
        if self._thread is not None:
            self._thread.join(timeout)

    def stats(self) -> dict:
        """running: sequences prefilling or decoding; waiting: queued for admission; slots_free: slots no
        sequence holds; cache_bytes_reserved: what the admitted sequences hold at their longest and one
        prefill piece's activations."""
        with self._lock:
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
        while True:
            with self._lock:
                while not self._stopped and not self.running and not self.prefilling and not self._admissible():
                    self._lock.wait()
                if self._stopped and not self.running and not self.prefilling:
                    for sequence in list(self.waiting):
                        self.waiting.remove(sequence)
                        self._finish(sequence, "cancelled")
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
                self._fail_running(e)

    def _admissible(self) -> bool:
        """Whether the oldest waiting sequence may start now (lock held): a slot is free, and its prefill
        cache and one of its prefill pieces fit beside what is held (the prefix cache gives way). Its piece
        shrinks to the room there is, down to 64 tokens (or the piece `submit` found fits the whole budget,
        if smaller): a long prompt prefills in smaller pieces rather than wait for a full one's room."""
        if not self.waiting or self.busy + self.lent >= self.slots:
            return False
        head = self.waiting[0]
        need = head.prompt_bytes + max(self._prefill_reserve(), head.prefill_reserved)
        if self.prefix is not None and self.room < need:
            self.prefix.evict(need - self.room)
        room = self.room - head.prompt_bytes
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
        """Move the waiting sequences that fit, oldest first, to the prefilling ones (lock held)."""
        while self._admissible():
            sequence = self.waiting.popleft()
            self.reserved += sequence.reserved
            self.prefill_held += sequence.prompt_bytes
            self.prefilling.append(sequence)
        self.peak_running = max(self.peak_running, self.busy)

    def _turn(self) -> None:
        """The decode forward over the running rows, then the prefill pieces (`_prefill_turn`), then one
        sample for the running rows and the sequences whose prompt is done (their logits kept by the prefill),
        which then join the running rows: a first token waits for no forward after its prompt's last. A
        decode forward that fails ends the running rows (`_fail_running`); the others go on."""
        rows, parts = [], []
        if self.running:
            rows = list(self.running)
            try:
                parts.append(self.pool.run(self._last, len(rows)))
            except Exception as e:
                log.exception("k3 serve: the decode forward failed; its %d sequences end with an error", len(rows))
                self._fail_running(e)
                rows = []
        self._prefill_turn()
        ready = list(self.ready)
        rows += ready
        parts += [s.first_logits for s in ready]
        if not rows:
            return
        tokens = draw(torch.cat(parts), rows, self.generator, self._finish).tokens
        n = len(rows) - len(ready)
        if n:
            self._last = torch.tensor(tokens[:n], device=self.device)
            self.steps += 1
            self._emit(rows[:n], tokens[:n])
        for sequence, token in zip(ready, tokens[n:]):
            if sequence.finish_reason is None and not sequence.cancelled:
                self._join(sequence, token)
            else:  # cancelled while it prefilled, or its sampling failed
                self._leave_prefill(sequence, "cancelled")

    def _join(self, sequence: Sequence, token: int) -> None:
        """A prefilled sequence's row moves into the next slot of the pool and it joins the running rows."""
        slot = len(self.running)
        self.pool.cache.copy_row(slot, sequence.cache, 0)
        new = torch.tensor([token], device=self.device)
        last = new if self._last is None else torch.cat([self._last, new])
        with self._lock:
            self.ready.remove(sequence)
            self.running.append(sequence)
            self.prefill_held -= sequence.prompt_bytes
            self._last, sequence.cache, sequence.first_logits = last, None, None
        self._emit([sequence], [token])

    def _leave_prefill(self, sequence: Sequence, reason: str) -> None:
        """A prefilling (or ready) sequence ends: its prefill cache and its reservation go."""
        with self._lock:
            (self.prefilling if sequence in self.prefilling else self.ready).remove(sequence)
            self.reserved -= sequence.reserved
            self.prefill_held -= sequence.prompt_bytes
            sequence.cache = sequence.first_logits = None
            self._finish(sequence, reason)

    def _emit(self, rows: list[Sequence], tokens: list[int]) -> None:
        for sequence, token in zip(rows, tokens):
            if sequence.finish_reason is not None or sequence.cancelled:
                continue
            if sequence.first_token_at is None:
                sequence.first_token_at = time.perf_counter()
            if token == sequence.eos_token_id:
                self._finish(sequence, "stop")
                continue
            sequence.tokens.append(token)
            try:
                sequence.on_token(token)
            except Exception as e:  # the callback's failure is its sequence's: the others go on
                log.exception("k3 serve: sequence %d's on_token callback raised; it ends", sequence.id)
                self._finish(sequence, f"error: {type(e).__name__}: {e}")
                continue
            if len(sequence.tokens) >= sequence.max_tokens:
                self._finish(sequence, "length")

    def _drop_ended(self) -> None:
        """Free the slots of the rows that finished, failed or were cancelled: the last running row moves
        into each (highest first, so the row moved has not ended)."""
        with self._lock:
            ended = []
            for i, sequence in enumerate(self.running):
                if sequence.cancelled and sequence.finish_reason is None:
                    self._finish(sequence, "cancelled")
                if sequence.finish_reason is not None:
                    ended.append(i)
            pool = self.pool.cache
            lengths = pool.lengths
            for i in reversed(ended):
                last = len(self.running) - 1
                self.reserved -= self.running[i].reserved
                if i != last:
                    pool.copy_row(i, pool, last)
                    lengths[i] = lengths[last]
                    self.running[i] = self.running[last]
                    self._last[i] = self._last[last]
                self.running.pop()
                lengths[last] = 0
            if ended:
                pool.lengths = lengths
                self._last = self._last[: len(self.running)] if self.running else None

    def _finish(self, sequence: Sequence, reason: str) -> None:
        if sequence.finish_reason is None:
            sequence.finish_reason = reason
            try:
                sequence.on_finish(reason)
            except Exception:  # a callback's failure is its request's, not the engine's
                log.exception("k3 serve: sequence %d's on_finish callback raised", sequence.id)

    def _fail_running(self, error: Exception) -> None:
        """The batch's forward failed: end every running sequence (and every one waiting for its first token)
        with the error; the prefilling ones, each in its own cache, go on."""
        for sequence in list(self.ready):
            self._leave_prefill(sequence, f"error: {type(error).__name__}: {error}")
        with self._lock:
            for sequence in self.running:
                self._finish(sequence, f"error: {type(error).__name__}: {error}")
                self.reserved -= sequence.reserved
            self.running, self._last = [], None
            self.pool.cache.lengths = [0] * self.slots
