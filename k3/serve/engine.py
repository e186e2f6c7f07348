"""The serving engine: continuous batching over one growing cache, with memory-aware admission.

One loop, on a thread of its own, owns the model. Each turn of it
1. admits waiting sequences, oldest first, while what they will hold fits the budget and fewer than
   `max_running` are prefilling or decoding;
2. prefills up to `prefill_tokens` prompt tokens, in pieces of at most `PREFILL_PIECE` tokens, each
   admitted sequence alone (its own cache, no padding) and in order: a long prompt takes several turns, so
   the running batch decodes between its pieces instead of waiting for the whole prompt. A sequence whose
   prompt is done has its first token sampled and its cache joined to the running batch's
   (`Cache.concat`);
3. decodes every running sequence together, one token each: one forward of [B, 1] through the joined
   cache, then each row sampled with its own settings and its own generator;
4. drops the sequences that finished (their token limit, their end-of-text token), failed or were
   cancelled (a client that went away, a stop string): `Cache.reorder` keeps the other rows and frees
   the slots no row needs any more.
A sequence joins once its prompt is prefilled and leaves at the turn it ends, so no one waits for a batch
to drain (Orca, Yu et al. 2022; vLLM). Rows of different lengths sit left-aligned in the cache, each at its
own position, which attention masks past; a recurrent state never sees a padding token, and every row
computes what it would alone.

A failure is contained where it happens: a sequence whose prefill or sampling raises ends alone with
"error: ..." (and a line in the log, logger "k3.serve"); only a failure of the shared decode forward ends
every running sequence.

Admission reserves what a sequence will hold at its longest, by k3's own accounting (`sequence_bytes`:
per token, the KV or latent cache of each attention layer; per sequence, the fixed states of the linear
family), and beside the caches the transient memory of one prefill piece, the largest of the prefilling
sequences' (`prefill_bytes`: attention masks, expanded keys, hidden states; one piece runs at a time),
against `cache_memory`; a long prompt is given smaller pieces when full ones would not fit (the budget, or
the room the running sequences leave). What does not fit waits in a bounded queue; past that bound `submit`
refuses (the server answers 503 with Retry-After). The budget is never overrun by k3's accounting, so load
does not end in an out-of-memory crash.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..inference.generation import check_sampling, check_seed, is_greedy, sample
from ..models.kinds import MIXERS, cache_bytes
from ..models.model import PREFILL_PIECE

log = logging.getLogger("k3.serve")


class QueueFull(RuntimeError):
    """The waiting queue is at its bound: try again later (HTTP 503)."""


class Draining(RuntimeError):
    """The engine is shutting down and admits nothing new (HTTP 503)."""


def sequence_bytes(config, tokens: int, dtype_bytes: int) -> int:
    """Cache bytes one sequence holds at `tokens` tokens: sum over layers of the KV / latent bytes per token
    times tokens, plus the fixed recurrent and convolution states (`k3.models.kinds.cache_bytes`)."""
    return cache_bytes(config, 1, tokens, dtype_bytes)


def prefill_bytes(config, piece: int, context: int, dtype_bytes: int) -> int:
    """Transient bytes of one prefill forward of `piece` tokens whose last one sits at `context` (an estimate
    that errs high; the layers run one at a time, so the largest counts): an attention layer's causal mask,
    piece x context (a bool and a float32 copy, with room to spare: torch's fused attention kernel never holds
    a head's scores), and MLA's per-head keys and values expanded from the context's latents; the piece's
    hidden states and widest FFN activations; the last position's logits."""
    H, attention = config.num_heads, 0
    for kind in set(config.layer_types):
        if MIXERS[kind].cache_bytes_per_token(config, dtype_bytes) == 0:
            continue  # the linear family: fixed states, chunked over the piece (counted with the hidden states)
        scores = 12 * piece * context
        if kind == "mla":
            head = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
            scores += 2 * context * H * head * dtype_bytes
        attention = max(attention, scores)
    experts = config.moe_intermediate_size * (config.num_experts_per_tok + config.num_shared_experts)
    widest = max(config.intermediate_size, experts, 3 * config.linear_num_heads * config.linear_head_dim)
    per_token = (8 * config.hidden_size + 3 * widest) * dtype_bytes
    return attention + piece * per_token + 4 * config.vocab_size


@dataclass(eq=False)
class Sequence:
    """One sequence to generate: its prompt (token ids), how many tokens at most, how to sample them.

    The engine calls `on_token(token_id)` for each new token and then `on_finish(reason)` once, on its own
    thread: reason "length" (max_tokens reached), "stop" (the end-of-text token, not passed to on_token),
    "cancelled" (`Engine.cancel`), or "error: ..." (its prefill or its sampling raised, or the batch's forward).
    Its settings are checked as it is made (`check_sampling`, `check_seed`): a ValueError naming the field."""

    prompt: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    eos_token_id: int | None = None
    on_token: Callable[[int], None] = lambda token: None
    on_finish: Callable[[str], None] = lambda reason: None
    id: int = field(default_factory=itertools.count().__next__)
    tokens: list[int] = field(default_factory=list)  # generated so far
    finish_reason: str | None = None
    reserved: int = 0  # cache bytes admission set aside for it
    piece: int = PREFILL_PIECE  # prompt tokens per prefill forward
    fitting_piece: int = PREFILL_PIECE  # the largest piece that fits the whole budget beside its cache
    prefill_reserved: int = 0  # the transient bytes of one of its prefill pieces (counted while it prefills)
    prefilled: int = 0  # prompt tokens in its cache so far
    cancelled: bool = False
    arrived: float = field(default_factory=time.perf_counter)

    def __post_init__(self):
        if not self.prompt:
            raise ValueError("Sequence: `prompt` is empty (at least one token)")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"Sequence: `max_tokens` must be an int >= 1, got {self.max_tokens!r}")
        check_sampling(self.temperature, self.top_k, self.top_p)
        check_seed(self.seed)
        self.generator: torch.Generator | None = None
        self.cache = None  # its own cache while it prefills

    @property
    def total_tokens(self) -> int:
        """The most tokens its cache will hold: the prompt and every token fed back (the last is only sampled)."""
        return len(self.prompt) + self.max_tokens - 1


class Engine:
    """Continuous batching for one model (see the module docstring). `cache_memory`: the bytes every
    admitted sequence's cache (and a prefilling one's piece) may take together; `max_queue`: how many may
    wait; `max_running`: how many prefill or decode at once at most; `prefill_tokens`: prompt tokens
    prefilled per turn before the running batch decodes again, so a long prompt or a burst of them does not
    stall the others for long."""

    def __init__(
        self, model, cache_memory: int, max_queue: int = 256, max_running: int = 256, prefill_tokens: int = 4096
    ):
        if cache_memory <= 0:
            raise ValueError(f"Engine: `cache_memory` must be > 0 bytes, got {cache_memory}")
        for name, value in (("max_queue", max_queue), ("max_running", max_running), ("prefill_tokens", prefill_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Engine: `{name}` must be an int >= 1, got {value!r}")
        self.model = model
        self.device = model.lm_head.weight.device
        self.dtype_bytes = model.lm_head.weight.element_size()
        self.cache_memory, self.max_queue = cache_memory, max_queue
        self.max_running, self.prefill_tokens = max_running, prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []  # admitted, prompt not yet all in their own caches
        self.running: list[Sequence] = []
        self.reserved = 0
        self.peak_running = 0
        self.steps = 0
        self._cache = None  # the running batch's cache, row i = running[i]
        self._fused = model.decoding_weights()  # the weight copies decoding reads (the weights do not change)
        self._last: torch.Tensor | None = None  # [B] the token each running row feeds next
        self._lock = threading.Condition()
        self._draining = self._stopped = False
        self._thread: threading.Thread | None = None

    # -- the public side, any thread ---------------------------------------------------------------
    def bytes_for(self, sequence: Sequence) -> int:
        """Cache bytes `sequence` holds at its longest."""
        return sequence_bytes(self.model.config, sequence.total_tokens, self.dtype_bytes)

    def plan(self, sequence: Sequence, room: int | None = None, smallest: int = 1) -> tuple[int, int]:
        """(prompt tokens per prefill piece, bytes one piece takes): the largest piece, up to PREFILL_PIECE
        and `prefill_tokens`, halved until its bytes fit `room` (default: the budget beside the sequence's
        cache) or it is down to `smallest` tokens."""
        piece = min(PREFILL_PIECE, self.prefill_tokens, len(sequence.prompt))
        room = self.cache_memory - self.bytes_for(sequence) if room is None else room
        while True:
            need = prefill_bytes(self.model.config, piece, len(sequence.prompt), self.dtype_bytes)
            if piece <= smallest or need <= room:
                return piece, need
            piece //= 2

    def submit(self, sequence: Sequence) -> None:
        """Queue a sequence. ValueError: it could never fit the budget; QueueFull, Draining: not now."""
        cache = self.bytes_for(sequence)
        piece, transient = self.plan(sequence)
        if cache + transient > self.cache_memory:
            raise ValueError(
                f"the sequence needs {cache + transient:,} bytes ({sequence.total_tokens} tokens of "
                f"cache: prompt and max_tokens; and its prefill), more than the server's whole cache "
                f"budget, {self.cache_memory:,} bytes (--cache-memory): ask for fewer tokens"
            )
        with self._lock:
            if self._draining:
                raise Draining("the server is shutting down")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are waiting already (the queue's bound, --max-queue)")
            sequence.reserved, sequence.fitting_piece, sequence.prefill_reserved = cache, piece, transient
            sequence.piece = piece
            self.waiting.append(sequence)
            self._lock.notify_all()

    def cancel(self, sequence: Sequence) -> None:
        """Stop a sequence: a waiting one leaves the queue now, a prefilling or running one at the next turn."""
        with self._lock:
            sequence.cancelled = True
            if sequence in self.waiting:
                self.waiting.remove(sequence)
                self._finish(sequence, "cancelled")
            self._lock.notify_all()

    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self._loop, name="k3-engine", daemon=True)
        self._thread.start()
        return self

    def drain(self) -> None:
        """Admit nothing new (submit raises Draining); what is queued or running goes on."""
        with self._lock:
            self._draining = True

    def stop(self, timeout: float | None = None) -> None:
        """Cancel everything queued or running and end the loop."""
        with self._lock:
            self._draining = self._stopped = True
            for sequence in list(self.waiting) + self.prefilling + self.running:
                sequence.cancelled = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def stats(self) -> dict:
        """running: sequences prefilling or decoding; waiting: queued for admission."""
        with self._lock:
            return {
                "running": len(self.running) + len(self.prefilling),
                "waiting": len(self.waiting),
                "cache_bytes_reserved": self.reserved + self._prefill_reserve(),
                "cache_memory": self.cache_memory,
                "peak_running": self.peak_running,
                "steps": self.steps,
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
                    self._prefill_turn()
                    self._drop_ended()
                    if self.running:
                        self._decode()
                    self._drop_ended()
            except Exception as e:  # the batch's own forward failed: fail what ran, keep serving
                log.exception(
                    "k3 serve: the batch's forward failed; its %d sequences end with an error", len(self.running)
                )
                self._fail_running(e)

    def _admissible(self) -> bool:
        """Whether the oldest waiting sequence may start now (lock held): a row is free, and its cache and
        one of its prefill pieces fit beside what is reserved. Its piece shrinks to the room there is, down
        to 64 tokens (or the piece `submit` found fits the whole budget, if smaller): a long prompt
        prefills in smaller pieces rather than wait for a full one's room."""
        if not self.waiting or len(self.running) + len(self.prefilling) >= self.max_running:
            return False
        head = self.waiting[0]
        room = self.cache_memory - self.reserved - head.reserved
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
            self.prefilling.append(sequence)
        self.peak_running = max(self.peak_running, len(self.running) + len(self.prefilling))

    def _prefill_turn(self) -> None:
        """Prefill up to `prefill_tokens` prompt tokens, oldest sequence first, a piece at a time; a sequence
        whose prompt is all in gets its first token and joins the running batch. One that fails ends alone."""
        budget = self.prefill_tokens
        while budget > 0 and self.prefilling:
            sequence = self.prefilling[0]
            if sequence.cancelled:
                self._leave_prefill(sequence, "cancelled")
                continue
            try:
                budget -= self._prefill_piece(sequence, budget)
            except Exception as e:
                log.error("k3 serve: sequence %d failed in its prefill: %s: %s", sequence.id, type(e).__name__, e)
                self._leave_prefill(sequence, f"error: {type(e).__name__}: {e}")

    def _prefill_piece(self, sequence: Sequence, budget: int) -> int:
        """Run the sequence's next piece (at most `budget` tokens) into its own cache; the tokens it ran."""
        if sequence.cache is None:
            sequence.generator = torch.Generator(self.device)
            if sequence.seed is not None:
                sequence.generator.manual_seed(sequence.seed)
            else:
                sequence.generator.seed()
            sequence.cache = self.model.new_cache(1)
        start = sequence.prefilled
        n = min(sequence.piece, budget, len(sequence.prompt) - start)
        ids = torch.tensor([sequence.prompt[start : start + n]], device=self.device)
        logits = self.model(ids, cache=sequence.cache, logits_to_keep=1, prefill_piece=n)[:, -1]
        sequence.prefilled += n
        if sequence.prefilled == len(sequence.prompt):
            token = self._sample(logits, [sequence])
            if sequence.finish_reason is None:
                self._join(sequence, token)
            else:  # its sampling failed
                self._leave_prefill(sequence, sequence.finish_reason)
        return n

    def _join(self, sequence: Sequence, token: torch.Tensor) -> None:
        """A prefilled sequence's cache and first token join the running batch."""
        cache = sequence.cache
        joined = cache if self._cache is None else type(cache).concat([self._cache, cache])
        last = token if self._last is None else torch.cat([self._last, token])
        with self._lock:
            self.prefilling.remove(sequence)
            self.running.append(sequence)
            self._cache, self._last, sequence.cache = joined, last, None
        self._emit([sequence], token)

    def _leave_prefill(self, sequence: Sequence, reason: str) -> None:
        with self._lock:
            self.prefilling.remove(sequence)
            self.reserved -= sequence.reserved
            sequence.cache = None
            self._finish(sequence, reason)

    def _decode(self) -> None:
        logits = self.model(self._last.unsqueeze(1), cache=self._cache, fused=self._fused)[:, -1]
        self._last = self._sample(logits, self.running)
        self.steps += 1
        self._emit(self.running, self._last)

    def _sample(self, logits: torch.Tensor, rows: list[Sequence]) -> torch.Tensor:
        """[B] the next token of each row: greedy rows together, sampled rows each with its own generator.
        A row whose sampling raises ends with the error (and a line in the log); its token is a placeholder
        that `_emit` skips and `_drop_ended` removes."""
        tokens = logits.float().argmax(-1)
        for i, s in enumerate(rows):
            if is_greedy(s.temperature) or s.finish_reason is not None:
                continue
            try:
                tokens[i] = sample(logits[i : i + 1], s.temperature, s.top_k, s.top_p, s.generator)[0]
            except Exception as e:
                log.error(
                    "k3 serve: sequence %d failed to sample (temperature %r, top_k %r, top_p %r): %s: %s",
                    s.id,
                    s.temperature,
                    s.top_k,
                    s.top_p,
                    type(e).__name__,
                    e,
                )
                self._finish(s, f"error: {type(e).__name__}: {e}")
        return tokens

    def _emit(self, rows: list[Sequence], tokens: torch.Tensor) -> None:
        for sequence, token in zip(rows, tokens.tolist()):
            if sequence.finish_reason is not None or sequence.cancelled:
                continue
            if token == sequence.eos_token_id:
                self._finish(sequence, "stop")
                continue
            sequence.tokens.append(token)
            sequence.on_token(token)
            if len(sequence.tokens) >= sequence.max_tokens:
                self._finish(sequence, "length")

    def _drop_ended(self) -> None:
        """Remove the rows that finished, failed or were cancelled from the batch and its cache."""
        with self._lock:
            keep = []
            for i, sequence in enumerate(self.running):
                if sequence.cancelled and sequence.finish_reason is None:
                    self._finish(sequence, "cancelled")
                if sequence.finish_reason is None:
                    keep.append(i)
                else:
                    self.reserved -= sequence.reserved
            if len(keep) == len(self.running):
                return
            self.running = [self.running[i] for i in keep]
            if not keep:
                self._cache = self._last = None
                return
            index = torch.tensor(keep, device=self.device)
            self._cache.reorder(index)
            self._cache.trim()
            self._last = self._last.index_select(0, index)

    def _finish(self, sequence: Sequence, reason: str) -> None:
        if sequence.finish_reason is None:
            sequence.finish_reason = reason
            try:
                sequence.on_finish(reason)
            except Exception:  # a callback's failure is its request's, not the engine's
                log.exception("k3 serve: sequence %d's on_finish callback raised", sequence.id)

    def _fail_running(self, error: Exception) -> None:
        """The batch's forward failed: end every running sequence with the error (the prefilling ones,
        each in its own cache, go on)."""
        with self._lock:
            for sequence in self.running:
                self._finish(sequence, f"error: {type(error).__name__}: {error}")
                self.reserved -= sequence.reserved
            self.running, self._cache, self._last = [], None, None
