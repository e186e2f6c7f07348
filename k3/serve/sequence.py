"""What the serving engine serves: a `Sequence` (a prompt, how to sample it, its callbacks, `check`ed as it
is made and at submit), the byte accounting it is admitted by (`sequence_bytes`, `prefill_bytes`, the
budget's `budget_bytes`), the engine's own arguments checked (`check_engine_arguments`), and the two
refusals of `submit` that mean "not now"."""

from __future__ import annotations

import itertools
import math
import operator
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..inference.generation import check_sampling, check_seed
from ..models import count_params
from ..models.kinds import MIXERS, cache_bytes
from ..models.model import PREFILL_PIECE
from ..ops.cost import mixer_macs_per_token
from ..runtime import available_memory

MAX_LOGPROBS = 20  # alternatives a token's logprobs may list (OpenAI's top_logprobs bound; vLLM's default)


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


def budget_bytes(cache_memory, device: torch.device) -> int:
    """`Engine`'s `cache_memory` in bytes: an int or a whole float (1e9), at least 1 and at most what
    `device` has free now (the GPU's free memory, else the machine's available memory); a ValueError naming
    it otherwise. A size string ('1GiB') is refused with the way to its bytes: `k3.serve.parse_bytes`, the
    CLI's parser, lives in the package above this module."""
    budget = cache_memory
    if isinstance(budget, float) and math.isfinite(budget) and budget.is_integer():
        budget = int(budget)
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        hint = f" (for a size: k3.serve.parse_bytes({cache_memory!r}))" if isinstance(cache_memory, str) else ""
        raise ValueError(f"Engine: `cache_memory` must be a number of bytes >= 1, got {cache_memory!r}{hint}")
    gpu = device.type == "cuda"
    free = torch.cuda.mem_get_info(device)[0] if gpu else available_memory()
    if free is not None and budget > free:
        raise ValueError(
            f"Engine: `cache_memory` {cache_memory!r} is {budget:,} bytes, more than the {free:,} bytes free "
            f"on {device if gpu else 'this machine'} now: give a smaller budget"
        )
    return budget


def check_engine_arguments(model, cache_memory, compile, prefix_cache, counts: dict) -> int:
    """`Engine`'s arguments checked, each refused in one line naming it (a count must be an int in
    range: a float NaN or a string would otherwise fail later, in a comparison or a forward); the budget in
    bytes (`budget_bytes`)."""
    for name, value in counts.items():
        low = {"prefill_chunk": 0, "max_length": 2}.get(name, 1)  # max_length: a prompt token and one more
        if value is None and name in ("max_length", "prefix_block", "max_num_batched_tokens", "threads"):
            continue  # their defaults
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"Engine: `{name}` must be an int >= {low}, got {value!r}")
    positions, longest = model.config.max_position_embeddings, counts["max_length"]
    if positions and longest is not None and longest > positions:
        raise ValueError(f"Engine: `max_length` must be <= {positions} (the model's learned positions), got {longest}")
    if not isinstance(prefix_cache, bool):
        raise ValueError(f"Engine: `prefix_cache` must be True or False, got {prefix_cache!r}")
    backends = torch._dynamo.list_backends(exclude_tags=()) if isinstance(compile, str) else ()
    if not isinstance(compile, bool) and compile not in backends:
        raise ValueError(f"Engine: `compile` must be True, False or a torch.compile backend name, got {compile!r}")
    return budget_bytes(cache_memory, model.lm_head.weight.device)


def prefill_macs_terms(config) -> tuple[float, float]:
    """(per token, per slot): the multiply-adds a prompt token costs whatever its place (its matmuls, the
    active parameters, and the linear mixers' chunk work at `chunk_size`), and those it costs for each slot
    it attends to (softmax attention 2 d, MLA H (d_qk + d_v), summed over the attention layers)."""
    per_token, per_slot = float(count_params(config).active), 0.0
    for kind in config.layer_types:
        if kind in ("mha", "mla"):  # a sequence of one token: its query reads one slot
            per_slot += mixer_macs_per_token(config, kind, 1)
        else:
            per_token += mixer_macs_per_token(config, kind, config.chunk_size)
    return per_token, per_slot


def prefill_macs(terms: tuple[float, float], tokens: int, context: int) -> float:
    """Multiply-adds of a prefill piece of `tokens` prompt tokens after `context` cached ones, from
    `prefill_macs_terms`: the i-th token attends to context + i + 1 slots, tokens (context + (tokens + 1) / 2)
    slots for the piece."""
    per_token, per_slot = terms
    return tokens * (per_token + per_slot * (context + (tokens + 1) / 2))


def tokens_within(terms: tuple[float, float], macs: float, context: int) -> int:
    """The most tokens a piece after `context` cached ones may hold for at most `macs` multiply-adds
    (`prefill_macs` <= macs): the root of (b / 2) n^2 + (a + b (context + 1/2)) n = macs."""
    a, b = terms
    p = a + b * (context + 0.5)
    n = macs / p if b == 0 else (math.sqrt(p * p + 2 * b * macs) - p) / b
    return max(0, int(n + 1e-9))


@dataclass(eq=False)
class Sequence:
    """One sequence to generate: its prompt (token ids), how many tokens at most, how to sample them
    (temperature, top_p, top_k, seed; OpenAI's presence and frequency penalties), and whether to record each
    token's log-probability with its `logprobs` likeliest alternatives (`token_logprobs`, filled before
    `on_token` is called for the token), and the same for its prompt (`prompt_logprobs`: filled as it
    prefills, in `prompt_token_logprobs`; such a prompt is prefilled whole, without the prefix cache).

    The engine calls `on_token(token_id)` for each new token and then `on_finish(reason)` once, on its own
    thread: reason "length" (max_tokens reached), "stop" (the end-of-text token, not passed to on_token),
    "cancelled" (`Engine.cancel`), or "error: ..." (its prefill, its sampling or its on_token callback raised,
    or the decode batch's forward): a failure of its own ends it alone.
    Its settings are checked as it is made and again at `Engine.submit` (`check`): a ValueError naming the
    field. `prompt` becomes a list of its own (ints), so the caller's list changing later changes nothing."""

    prompt: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    eos_token_id: int | None = None
    on_token: Callable[[int], None] = lambda token: None
    on_finish: Callable[[str], None] = lambda reason: None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: none; k: each token's log-probability and its k likeliest alternatives
    prompt_logprobs: int | None = None  # the same for its prompt's tokens after the first (vLLM's name)
    id: int = field(default_factory=itertools.count().__next__)
    tokens: list[int] = field(default_factory=list)  # generated so far
    finish_reason: str | None = None
    reserved: int = 0  # cache bytes it holds at its longest
    piece: int = PREFILL_PIECE  # prompt tokens per prefill forward
    fitting_piece: int = PREFILL_PIECE  # the largest piece that fits the whole budget beside its cache
    prefill_reserved: int = 0  # the transient bytes of one of its prefill pieces (counted while it prefills)
    prefilled: int = 0  # prompt tokens in its row so far
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache
    cancelled: bool = False
    arrived: float = field(default_factory=time.perf_counter)

    def __post_init__(self):
        self.check()
        self.generator: torch.Generator | None = None  # its own when seeded (`k3.serve.sampler`)
        self.output_counts: torch.Tensor | None = None  # [V] its tokens' counts, kept when it has penalties
        self.token_logprobs: list[tuple[float, list[tuple[int, float]]]] = []  # per token, when `logprobs`
        self.prompt_token_logprobs: list[tuple[float, list[tuple[int, float]]]] = []  # prompt[1:]'s, when asked
        self.row: int | None = None  # the slot pool's row it holds from admission to its end
        self.started = False  # its row emptied (and its cached prefix restored) for its prompt
        self.first_logits: torch.Tensor | None = None  # [1, V] once its prompt is in, until its first token
        self.first_token_at: float | None = None
        self.submitted = False  # an engine has queued it (a sequence runs once)

    def check(self, vocab_size: int | None = None) -> None:
        """ValueError naming the field unless every setting is in range: the prompt a non-empty list of
        token ids (ints; in [0, vocab_size) when given, as `eos_token_id`), `max_tokens` an int >= 1, the
        sampling settings (`check_sampling`, `check_seed`), the penalties in [-2, 2] (OpenAI's range),
        `logprobs` None or at most MAX_LOGPROBS alternatives, the callbacks callable. A token id out of range
        would otherwise fail much later, inside the prefill's forward."""
        self.prompt = token_ids(self.prompt, vocab_size)
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"Sequence: `max_tokens` must be an int >= 1, got {self.max_tokens!r}")
        check_sampling(self.temperature, self.top_k, self.top_p)
        check_seed(self.seed)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not -2 <= value <= 2:
                raise ValueError(f"Sequence: `{name}` must be a number in [-2, 2], got {value!r}")
        for name in ("logprobs", "prompt_logprobs"):
            top = getattr(self, name)
            if top is not None and (not _is_int(top) or not 0 <= top <= MAX_LOGPROBS):
                raise ValueError(f"Sequence: `{name}` must be None or an int in [0, {MAX_LOGPROBS}], got {top!r}")
        eos, high = self.eos_token_id, "" if vocab_size is None else f" and < {vocab_size} (the vocabulary)"
        if eos is not None and (not _is_int(eos) or eos < 0 or (vocab_size is not None and eos >= vocab_size)):
            raise ValueError(f"Sequence: `eos_token_id` must be None or an int >= 0{high}, got {eos!r}")
        for name in ("on_token", "on_finish"):
            if not callable(getattr(self, name)):
                raise ValueError(f"Sequence: `{name}` must be callable, got {getattr(self, name)!r}")

    @property
    def held(self) -> int:
        """The tokens its row holds: the prompt's prefilled so far, then each generated token fed back (the
        newest is fed at the next turn); the device's record is its row's position."""
        return self.prefilled + max(len(self.tokens) - 1, 0)

    @property
    def total_tokens(self) -> int:
        """The most tokens its cache will hold: the prompt and every token fed back (the last is only sampled)."""
        return len(self.prompt) + self.max_tokens - 1


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def token_ids(prompt, vocab_size: int | None = None) -> list[int]:
    """`prompt` as a new list of ints (any integers: Python's, NumPy's, a 1-D integer tensor's), each in
    [0, vocab_size) when given; ValueError naming the first one that is not."""
    try:
        items = None if isinstance(prompt, (str, bytes)) else list(prompt)  # a string is text, not ids
    except TypeError:
        items = None
    if items is None:
        raise ValueError(f"Sequence: `prompt` must be a list of token ids (ints), got {prompt!r}")
    if not items:
        raise ValueError("Sequence: `prompt` is empty (at least one token)")
    ids = []
    for i, item in enumerate(items):
        try:
            token = None if isinstance(item, bool) else operator.index(item)
        except TypeError:
            token = None
        if token is None or token < 0 or (vocab_size is not None and token >= vocab_size):
            bounds = "an int >= 0" if vocab_size is None else f"an int in [0, {vocab_size}) (the vocabulary)"
            raise ValueError(f"Sequence: `prompt[{i}]` must be a token id, {bounds}, got {item!r}")
        ids.append(token)
    return ids
