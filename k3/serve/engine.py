"""The serving engine: continuous batching over one growing HybridCache, with memory-aware admission.

One loop, on a thread of its own, owns the model. Each turn of it
1. admits waiting sequences, oldest first, while their cache bytes fit the budget: each is prefilled
   alone (its own cache, no padding), its first token sampled, and its cache joined to the running
   batch's (`HybridCache.concat`);
2. decodes every running sequence together, one token each: one forward of [B, 1] through the joined
   cache, then each row sampled with its own settings and its own generator;
3. drops the sequences that finished (their token limit, their end-of-text token) or were cancelled
   (a client that went away, a stop string): `HybridCache.reorder` keeps the other rows and `trim`
   frees the slots no row needs any more.
A sequence joins at the next turn after it arrives and leaves at the turn it ends, so no one waits for
a batch to drain (Orca, Yu et al. 2022; vLLM). Rows of different lengths share the cache's slot axis
behind `pad`, which attention masks; a recurrent state never sees a padding token, and every row
computes what it would alone.

Admission reserves what a sequence will hold at its longest, by k3's own accounting (`sequence_bytes`:
per token, the KV or latent cache of each attention layer; per sequence, the fixed states of the linear
family), against `cache_memory`. What does not fit waits in a bounded queue; past that bound `submit`
refuses (the server answers 503 with Retry-After). A budget is never overrun, so load never ends in an
out-of-memory crash.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..generation import check_sampling, is_greedy, sample
from ..models.kinds import MIXERS


class QueueFull(RuntimeError):
    """The waiting queue is at its bound: try again later (HTTP 503)."""


class Draining(RuntimeError):
    """The engine is shutting down and admits nothing new (HTTP 503)."""


def sequence_bytes(config, tokens: int, dtype_bytes: int) -> int:
    """Cache bytes one sequence holds at `tokens` tokens: sum over layers of the KV / latent bytes per token
    times tokens, plus the fixed recurrent and convolution states (`k3.models.kinds`)."""
    per_token = sum(MIXERS[kind].cache_bytes_per_token(config, dtype_bytes) for kind in config.layer_types)
    fixed = sum(MIXERS[kind].state_bytes(config, dtype_bytes) for kind in config.layer_types)
    return per_token * tokens + fixed


@dataclass(eq=False)
class Sequence:
    """One sequence to generate: its prompt (token ids), how many tokens at most, how to sample them.

    The engine calls `on_token(token_id)` for each new token and then `on_finish(reason)` once, on its own
    thread: reason "length" (max_tokens reached), "stop" (the end-of-text token, not passed to on_token),
    "cancelled" (`Engine.cancel`), or "error: ..." (the model raised)."""

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
    cancelled: bool = False
    arrived: float = field(default_factory=time.perf_counter)

    def __post_init__(self):
        if not self.prompt:
            raise ValueError("Sequence: `prompt` is empty (at least one token)")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"Sequence: `max_tokens` must be an int >= 1, got {self.max_tokens!r}")
        check_sampling(self.temperature, self.top_k, self.top_p)
        self.generator: torch.Generator | None = None

    @property
    def total_tokens(self) -> int:
        """The most tokens its cache will hold: the prompt and every token fed back (the last is only sampled)."""
        return len(self.prompt) + self.max_tokens - 1


class Engine:
    """Continuous batching for one model (see the module docstring). `cache_memory`: the bytes every
    admitted sequence's cache may take together; `max_queue`: how many may wait; `max_running`: how many
    decode together at most; `prefill_tokens`: prompt tokens prefilled per turn before the running batch
    decodes again (at least one prompt), so a burst of long prompts does not stall the others for long."""

    def __init__(self, model, cache_memory: int, max_queue: int = 256, max_running: int = 256,
                 prefill_tokens: int = 4096):
        if cache_memory <= 0:
            raise ValueError(f"Engine: `cache_memory` must be > 0 bytes, got {cache_memory}")
        self.model = model
        self.device = model.lm_head.weight.device
        self.dtype_bytes = model.lm_head.weight.element_size()
        self.cache_memory, self.max_queue = cache_memory, max_queue
        self.max_running, self.prefill_tokens = max_running, prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.reserved = 0
        self.peak_running = 0
        self.steps = 0
        self._cache = None  # the running batch's HybridCache, row i = running[i]
        self._last: torch.Tensor | None = None  # [B] the token each running row feeds next
        self._lock = threading.Condition()
        self._draining = self._stopped = False
        self._thread: threading.Thread | None = None

    # -- the public side, any thread ---------------------------------------------------------------
    def bytes_for(self, sequence: Sequence) -> int:
        return sequence_bytes(self.model.config, sequence.total_tokens, self.dtype_bytes)

    def submit(self, sequence: Sequence) -> None:
        """Queue a sequence. ValueError: it could never fit the budget; QueueFull, Draining: not now."""
        need = self.bytes_for(sequence)
        if need > self.cache_memory:
            raise ValueError(f"the sequence needs {need:,} bytes of cache ({sequence.total_tokens} tokens: prompt "
                             f"and max_tokens), more than the server's whole cache budget, {self.cache_memory:,} "
                             f"bytes (--cache-memory): ask for fewer tokens")
        with self._lock:
            if self._draining:
                raise Draining("the server is shutting down")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are waiting already (the queue's bound, --max-queue)")
            sequence.reserved = need
            self.waiting.append(sequence)
            self._lock.notify_all()

    def cancel(self, sequence: Sequence) -> None:
        """Stop a sequence: a waiting one leaves the queue now, a running one its batch at the next turn."""
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
            for sequence in list(self.waiting) + self.running:
                sequence.cancelled = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def stats(self) -> dict:
        with self._lock:
            return {"running": len(self.running), "waiting": len(self.waiting), "cache_bytes_reserved": self.reserved,
                    "cache_memory": self.cache_memory, "peak_running": self.peak_running, "steps": self.steps,
                    "draining": self._draining}

    # -- the loop, its own thread ------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopped and not self.running and not self._admissible():
                    self._lock.wait()
                if self._stopped and not self.running:
                    for sequence in list(self.waiting):
                        self.waiting.remove(sequence)
                        self._finish(sequence, "cancelled")
                    return
                admitted = [] if self._stopped else self._admit()
            try:
                with torch.inference_mode():
                    for sequence in admitted:
                        self._prefill(sequence)
                    self._drop_ended()
                    if self.running:
                        self._decode()
                    self._drop_ended()
            except Exception as e:  # the model failed: fail what ran, keep serving
                self._fail_all(e)

    def _admissible(self) -> bool:
        if not self.waiting or len(self.running) >= self.max_running:
            return False
        return self.reserved + self.waiting[0].reserved <= self.cache_memory

    def _admit(self) -> list[Sequence]:
        """Take the waiting sequences that fit, oldest first, up to `prefill_tokens` prompt tokens (lock held)."""
        admitted, tokens = [], 0
        while self._admissible() and (not admitted or tokens + len(self.waiting[0].prompt) <= self.prefill_tokens):
            sequence = self.waiting.popleft()
            self.reserved += sequence.reserved
            tokens += len(sequence.prompt)
            admitted.append(sequence)
        self.running.extend(admitted)  # rows join the cache in _prefill, in this order
        self.peak_running = max(self.peak_running, len(self.running))
        return admitted

    def _prefill(self, sequence: Sequence) -> None:
        sequence.generator = torch.Generator(self.device)
        if sequence.seed is not None:
            sequence.generator.manual_seed(sequence.seed)
        else:
            sequence.generator.seed()
        cache = self.model.new_cache(1)
        prompt = torch.tensor([sequence.prompt], device=self.device)
        logits = self.model(prompt, cache=cache, logits_to_keep=1)[:, -1]
        token = self._sample(logits, [sequence])
        self._cache = cache if self._cache is None else type(cache).concat([self._cache, cache])
        self._last = token if self._last is None else torch.cat([self._last, token])
        self._emit([sequence], token)

    def _decode(self) -> None:
        logits = self.model(self._last.unsqueeze(1), cache=self._cache)[:, -1]
        self._last = self._sample(logits, self.running)
        self.steps += 1
        self._emit(self.running, self._last)

    def _sample(self, logits: torch.Tensor, rows: list[Sequence]) -> torch.Tensor:
        """[B] the next token of each row: greedy rows together, sampled rows each with its own generator."""
        tokens = logits.float().argmax(-1)
        for i, s in enumerate(rows):
            if not is_greedy(s.temperature):
                tokens[i] = sample(logits[i:i + 1], s.temperature, s.top_k, s.top_p, s.generator)[0]
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
        """Remove the rows that finished or were cancelled from the batch and its cache."""
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
            sequence.on_finish(reason)

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            for sequence in self.running:
                self._finish(sequence, f"error: {type(error).__name__}: {error}")
                self.reserved -= sequence.reserved
            self.running, self._cache, self._last = [], None, None
