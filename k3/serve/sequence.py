"""What the serving engine serves: a `Sequence` (a prompt, how to sample it, its callbacks), the byte
accounting it is admitted by (`sequence_bytes`, `prefill_bytes`), and the two refusals of `submit`."""

from __future__ import annotations

import itertools
import logging
import time
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
    reserved: int = 0  # cache bytes it holds at its longest
    prompt_bytes: int = 0  # its prefill cache's bytes (held while it prefills)
    piece: int = PREFILL_PIECE  # prompt tokens per prefill forward
    fitting_piece: int = PREFILL_PIECE  # the largest piece that fits the whole budget beside its cache
    prefill_reserved: int = 0  # the transient bytes of one of its prefill pieces (counted while it prefills)
    prefilled: int = 0  # prompt tokens in its cache so far
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache
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
        self.first_token_at: float | None = None

    @property
    def total_tokens(self) -> int:
        """The most tokens its cache will hold: the prompt and every token fed back (the last is only sampled)."""
        return len(self.prompt) + self.max_tokens - 1


def sample_rows(logits: torch.Tensor, rows: list[Sequence], fail) -> torch.Tensor:
    """[B] the next token of each row: greedy rows together, sampled rows each with its own generator. A
    row whose sampling raises is ended by `fail(sequence, "error: ...")` (and a line in the log); its token
    is a placeholder the engine skips and then drops."""
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
            fail(s, f"error: {type(e).__name__}: {e}")
    return tokens
