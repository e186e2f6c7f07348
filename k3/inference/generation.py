"""Sampling and generation through the hybrid cache: a chunked prefill, then one recurrent step per token.

A long prompt is prefilled a piece at a time (`k3.models.model.PREFILL_PIECE` tokens), each piece after
the cache the previous one left: memory grows linearly with the prompt, and only the last position's
logits are computed.

Prompts of different lengths (a list) are prefilled without padding, each length's prompts as one
batch, and their caches joined (`Cache.concat`: each row left-aligned at its own position): no padding
token enters a recurrent state or a KV cache, and every row generates what it would alone.

A stream can also continue a cache that has seen earlier tokens (`stream(..., cache=)`, `extend`): a
conversation's next turn runs only its own tokens.
"""

from __future__ import annotations

import math
from typing import Iterator, Sequence

import torch

from ..runtime import check_compiler, refuse_if_over_memory

Prompts = torch.Tensor | Sequence[Sequence[int] | torch.Tensor]  # [B, T], or B prompts of any lengths


MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes seeds in [0, 2**64)
# below float32's smallest normal number a temperature cannot divide a float32 logit: such a temperature is
# sampled as the limit it approaches, greedy; above float32's largest, as float32's largest (uniform)
GREEDY_BELOW = torch.finfo(torch.float32).tiny
_HOTTEST = torch.finfo(torch.float32).max


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_sampling(temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None) -> None:
    """A clear error for sampling settings out of range: temperature a finite number >= 0 (0: greedy),
    top_k an int >= 1 or None, top_p a number in (0, 1] or None. Every value in range samples finitely
    (`sampling_probs`): a temperature below `GREEDY_BELOW` is greedy, and the most likely token always stays
    in top_p's set, so a top_p too small for any other token is greedy too."""
    if not _is_number(temperature) or not 0 <= temperature < math.inf:  # NaN fails both comparisons
        raise ValueError(f"sample: `temperature` must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"sample: `top_k` must be an int >= 1 or None, got {top_k!r}")
    if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
        raise ValueError(f"sample: `top_p` must be a number in (0, 1] or None, got {top_p!r}")


def check_seed(seed, name: str = "seed") -> None:
    """A clear error for a random seed that torch.Generator cannot take: an int in [0, 2**64 - 1] (or None)."""
    if seed is None:
        return
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"`{name}` must be an int in [0, 2**64 - 1] = [0, {MAX_SEED}], got {seed!r}")


def is_greedy(temperature: float) -> bool:
    """Whether sampling at `temperature` is the argmax (0, or too small to divide a float32 logit)."""
    return temperature < GREEDY_BELOW


def sampling_probs(
    logits: torch.Tensor, temperature: float, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """logits [B, V] -> the probabilities [B, V] (float32) sampling draws from at temperature > 0:
    softmax((logits - max) / temperature) over the top_k most likely tokens and then the smallest set whose
    probability reaches top_p (nucleus; the most likely token always stays), the rest 0. Subtracting the
    maximum first keeps every temperature in range finite: at the smallest ones the distribution becomes
    one-hot on the argmax (shared among ties), the limit it approaches."""
    logits = logits.float()
    logits = (logits - logits.amax(-1, keepdim=True)) / min(temperature, _HOTTEST)
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p; the first one always stays
        drop = probs.cumsum(-1) - probs >= top_p
        drop[..., 0] = False
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits.softmax(-1)


def sample(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits [B, V] -> token ids [B]. temperature 0 is greedy; top_k keeps the k most likely tokens,
    top_p the smallest set whose probability reaches p (nucleus); both apply before sampling. The draw is
    `sample_with_noise`'s with noise from `generator`: the compiled decode step draws the same tokens for
    the same generator state."""
    check_sampling(temperature, top_k, top_p)
    return sample_with_noise(logits, _noise(logits, temperature, generator), temperature, top_k, top_p)


def sample_with_noise(
    logits: torch.Tensor,
    noise: torch.Tensor | None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """`sample` with its randomness given: noise [B, V] ~ Exponential(1) (None when greedy), drawn by
    the caller. token = argmax_i p_i / E_i, a draw from p (the exponential race: the first of V
    exponential clocks of rates p_i to ring is i with probability p_i). No generator and no host sync
    inside, so a compiled decode step samples within its graph (gpt-fast's `multinomial_sample_one_no_sync`).
    A clock of 0 (a uniform draw of exactly 0) would give 0 / 0 for a dropped token: the clamp keeps it 0."""
    if is_greedy(temperature):
        return logits.float().argmax(-1)
    return (sampling_probs(logits, temperature, top_k, top_p) / noise.clamp_min(GREEDY_BELOW)).argmax(-1)


def _noise(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor | None:
    """Exponential(1) noise like logits for `sample_with_noise` (None when greedy)."""
    if is_greedy(temperature):
        return None
    return torch.empty(logits.shape, device=logits.device).exponential_(generator=generator)


def refuse_text(prompts) -> None:
    """A TypeError for a prompt given as text: the model takes token ids (`tokenizer.encode(text)`)."""
    texts = (
        [prompts]
        if isinstance(prompts, str)
        else ([p for p in prompts if isinstance(p, str)] if isinstance(prompts, (list, tuple)) else [])
    )
    if texts:
        raise TypeError(
            f"generate: the prompt is text ({texts[0][:40]!r}), but the model takes token ids; encode it "
            f"first: tokenizer = k3.tokenizer.Tokenizer.load(checkpoint); "
            f"model.generate([tokenizer.encode(text)], ...), then tokenizer.decode(row)"
        )


def as_prompt_list(prompts, device=None) -> list[torch.Tensor]:
    """A list of prompts (token-id lists or 1-D tensors, each non-empty) as 1-D int64 tensors."""
    refuse_text(prompts)
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(
            f"generate: the prompts must be a [B, T] tensor or a list of token-id lists, got {type(prompts).__name__}"
        )
    out = []
    for i, p in enumerate(prompts):
        try:
            ids = torch.as_tensor(p)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"generate: prompt {i} must be a sequence of token ids (ints), got {p!r:.60}") from None
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(
                f"generate: prompt {i} must be a non-empty sequence of token ids, got shape {list(ids.shape)}"
            )
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:  # 1.5 is no token id
            raise ValueError(f"generate: prompt {i} must hold integer token ids, got {ids.dtype}: {p!r:.60}")
        ids = ids.to(dtype=torch.long, device=device)
        out.append(ids)
    if not out:
        raise ValueError("generate: the list of prompts is empty")
    return out


def check_positions(model, lengths: Sequence[int], max_new_tokens: int = 1, which: str | None = None) -> None:
    """A model with learned positions (GPT-2: `max_position_embeddings`) must fit every prompt and the
    tokens fed back after it (max_new_tokens - 1: the last one is only sampled); a clear error if not.
    `which` names the sequence in the error (default: "the prompt", or "prompt i" of several)."""
    positions = getattr(model.config, "max_position_embeddings", None)
    if not positions:
        return
    longest = max(lengths)
    index = list(lengths).index(longest)
    which = which or ("the prompt" if len(lengths) == 1 else f"prompt {index}")
    if longest > positions:
        raise ValueError(
            f"generate: {which} has {longest} tokens; {model.config.name!r} has learned positions "
            f"for {positions} tokens (max_position_embeddings): shorten it to at most {positions}"
        )
    if longest + max_new_tokens - 1 > positions:
        raise ValueError(
            f"generate: {which} has {longest} tokens and `max_new_tokens` is {max_new_tokens}, "
            f"{longest + max_new_tokens - 1} positions in all; {model.config.name!r} has learned "
            f"positions for {positions}: ask for at most {positions - longest + 1} new tokens"
        )


def prefill(model, prompts: Prompts, max_new_tokens: int = 1, static: bool = False):
    """Run the prompts into a new cache: ([B] logits of each prompt's last position, the cache).

    A [B, T] tensor is one batched prefill. A list of prompts of different lengths is prefilled one
    length at a time (the prompts of equal length as one batch) and the caches joined in the list's
    order (`Cache.concat`), so no row ever sees another's padding. Each prefill runs in pieces
    (see the module docstring). `max_new_tokens`: how many tokens will follow, for the position check.
    `static`: the cache has fixed slots with room for them (`static_slots`): a [B, T] prompt runs
    straight into it, a list's caches are joined into one."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2 or prompts.shape[1] == 0:
            raise ValueError(f"generate: the prompt `input_ids` must be [B, T] with T >= 1, got {list(prompts.shape)}")
        check_positions(model, [prompts.shape[1]], max_new_tokens)
        model.check_tokens(prompts)
        B, T = prompts.shape
        cache = model.new_cache(B, max_length=static_slots(model, T, max_new_tokens)) if static else model.new_cache(B)
        return model(prompts, cache=cache, logits_to_keep=1)[:, -1], cache
    prompts = as_prompt_list(prompts, device=next(model.parameters()).device)  # where the model runs
    check_positions(model, [p.numel() for p in prompts], max_new_tokens)
    model.check_tokens(torch.cat(prompts))
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_length.setdefault(p.numel(), []).append(i)
    caches, logits, order = [], [], []
    for rows in by_length.values():
        cache = model.new_cache(len(rows))
        logits.append(model(torch.stack([prompts[i] for i in rows]), cache=cache, logits_to_keep=1)[:, -1])
        caches.append(cache)
        order += rows
    cache = caches[0] if len(caches) == 1 else type(caches[0]).concat(caches)  # rows left-aligned, any lengths
    logits = torch.cat(logits)
    if order != sorted(order):  # back to the list's order
        back = torch.argsort(torch.tensor(order))
        cache.reorder(back)
        logits = logits[back.to(logits.device)]
    if static:
        longest = max(p.numel() for p in prompts)
        cache = type(cache).concat([cache], max_length=static_slots(model, longest, max_new_tokens))
    return logits, cache


def extend(model, input_ids: torch.Tensor, cache, max_new_tokens: int = 1) -> torch.Tensor:
    """Run `input_ids` [B, T] into a cache after the tokens it has seen (a conversation's next turn):
    [B] logits of the last position; the cache is updated in place."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0:
        shape = list(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"generate: with a `cache`, `input_ids` must be a [B, T] tensor with T >= 1, got {shape}")
    if input_ids.shape[0] != cache.batch_size:
        raise ValueError(
            f"generate: the cache holds {cache.batch_size} sequences, `input_ids` has {input_ids.shape[0]}"
        )
    check_positions(
        model,
        [cache.length + input_ids.shape[1]],
        max_new_tokens,
        which=f"the context ({cache.length} tokens in the cache, {input_ids.shape[1]} new)",
    )
    model.check_tokens(input_ids)
    return model(input_ids, cache=cache, logits_to_keep=1)[:, -1]


def static_length(tokens: int) -> int:
    """The slots a static cache gets for rows of up to `tokens` tokens: a power of two from 256 up to 1,024,
    then a multiple of 1,024. Few distinct sizes, so few compiled graphs (each size is one), at most a
    quarter of the slots spare past 4,096 tokens (attention reads them all, masked)."""
    if tokens <= 1024:
        return max(256, 1 << (tokens - 1).bit_length())
    return -(-tokens // 1024) * 1024


def compiled_prefill(model, prompts: Prompts, max_new_tokens: int, cache=None):
    """`prefill(static=True)`, or `extend` when given a cache of fixed slots, for `compile=True`: ([B] logits of
    each prompt's last position, the cache)."""
    if cache is None:
        return prefill(model, prompts, max_new_tokens, static=True)
    if not cache.max_length:
        raise ValueError(
            f"generate: `compile=True` decodes over a static cache; pass one made with "
            f"model.new_cache(batch_size, max_length=N), or no cache, not a {type(cache).__name__}"
        )
    if isinstance(prompts, torch.Tensor) and prompts.dim() == 2:
        cache.check_room(prompts.shape[1] + max_new_tokens - 1)
    return extend(model, prompts, cache, max_new_tokens), cache


def check_cache_fits(model, prompts: Prompts, max_new_tokens: int, cache=None) -> None:
    """A ValueError, before anything is allocated, when the cache these prompts and `max_new_tokens` need at
    their longest (`CausalLM.cache_bytes`, the most a static cache allocates) is more than this
    machine's memory."""
    if isinstance(prompts, torch.Tensor):
        rows, longest = (prompts.shape[0], prompts.shape[-1]) if prompts.dim() == 2 else (1, prompts.numel())
    else:
        rows, longest = len(prompts), max((len(p) for p in prompts), default=0)
    if cache is not None:
        longest += cache.length
    tokens = longest + max(max_new_tokens - 1, 0)
    refuse_if_over_memory(
        f"generate: {rows} sequence(s) of up to {longest:,} prompt tokens and {max_new_tokens:,} "
        f"new ones, the cache of {model.config.name!r} at {tokens:,} tokens",
        model.cache_bytes(rows, tokens),
        "ask for fewer new tokens (k3 generate --max-new-tokens), or give fewer or shorter prompts",
    )


def static_slots(model, longest: int, max_new_tokens: int) -> int:
    """`static_length` of a prompt of `longest` tokens and the tokens fed back after it, within the learned
    positions of a model that has them."""
    slots = static_length(longest + max(max_new_tokens - 1, 0))
    positions = model.config.max_position_embeddings
    return min(slots, positions) if positions else slots


@torch.no_grad()
def stream(
    model,
    input_ids: Prompts,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
    cache=None,
    compile: bool | str = False,
) -> Iterator[torch.Tensor]:
    """Yield the next token [B] of every sequence, max_new_tokens times or until all have emitted
    eos_token_id (a finished sequence keeps yielding eos). `input_ids`: [B, T], or a list of B prompts
    of any lengths.

    With `cache` (`model.new_cache`'s, holding earlier tokens, e.g. the conversation so far), `input_ids` [B, T]
    continue after what it has seen, and it is updated in place: at the end it has seen everything but
    the last token yielded (sampled, not yet fed back; the next turn starts with it).

    `compile=True` decodes with a compiled step over a static cache (`k3.inference.decode_step`: inductor
    on the CPU, CUDA graphs on CUDA; the first call of a model and batch size compiles, later ones, in this
    process or the next, reuse it). Both paths sample by one rule (`sample`'s exponential race, its noise
    drawn from `generator` in the same order), so they give the same tokens for the same seed. A
    `cache` given with it must be static (`model.new_cache(batch_size, max_length=N)`)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"generate: `max_new_tokens` must be an int >= 0, got {max_new_tokens!r}")
    check_sampling(temperature, top_k, top_p)
    meta = next((name for name, p in model.named_parameters() if p.is_meta), None)
    if meta is not None:
        raise ValueError(
            f"generate: the model's weights are on the meta device ({meta} first; a model built under "
            f"torch.device('meta') has shapes, no values): load them (CausalLM.from_pretrained), or "
            f"model.to_empty(device='cpu') and initialize them"
        )
    vocab = model.config.vocab_size
    if eos_token_id is not None and (
        not isinstance(eos_token_id, int) or isinstance(eos_token_id, bool) or not 0 <= eos_token_id < vocab
    ):
        raise ValueError(f"generate: `eos_token_id` must be None or a token id in [0, {vocab}), got {eos_token_id!r}")
    check_cache_fits(model, input_ids, max_new_tokens, cache)
    step = None
    if compile:
        if compile is True:
            check_compiler(next(model.parameters()).device)
        logits, cache = compiled_prefill(model, input_ids, max(max_new_tokens, 1), cache)
        if max_new_tokens > 1:
            step = model.decode_step(cache, temperature, top_k, top_p, generator, compile=compile)
    elif cache is None:
        logits, cache = prefill(model, input_ids, max(max_new_tokens, 1))
    else:
        logits = extend(model, input_ids, cache, max(max_new_tokens, 1))
    # eager decoding reads the decode step's weight copies too (made now: the weights as they are)
    fused = model.decoding_weights() if step is None and max_new_tokens > 1 else None
    done = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    token = None
    for i in range(max_new_tokens):
        if step is not None and token is not None:
            token = step(token)
        else:
            token = sample(logits, temperature, top_k, top_p, generator)
        if eos_token_id is not None:
            token = token.masked_fill(done, eos_token_id)
            done |= token == eos_token_id
        yield token
        if eos_token_id is not None and bool(done.all()):
            return
        if step is None and i + 1 < max_new_tokens:
            logits = model(token.unsqueeze(1), cache=cache, fused=fused)[:, -1]


def generate(
    model,
    input_ids: Prompts,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
    compile: bool | str = False,
) -> torch.Tensor | list[torch.Tensor]:
    """Prompt [B, T] -> prompt and new tokens [B, T + n], n <= max_new_tokens. A list of prompts of any
    lengths -> a list of 1-D tensors, each its prompt and its new tokens, up to and including its first
    eos_token_id. `compile`: see `stream`."""
    new = list(
        stream(model, input_ids, max_new_tokens, temperature, top_k, top_p, eos_token_id, generator, compile=compile)
    )
    if isinstance(input_ids, torch.Tensor):
        return torch.cat([input_ids, torch.stack(new, dim=1)], dim=1) if new else input_ids.clone()
    prompts = as_prompt_list(input_ids)
    tokens = torch.stack(new, dim=1) if new else torch.empty(len(prompts), 0, dtype=torch.long)
    out = []
    for prompt, row in zip(prompts, tokens):
        if eos_token_id is not None and bool((row == eos_token_id).any()):
            row = row[: int((row == eos_token_id).nonzero()[0]) + 1]
        out.append(torch.cat([prompt, row.to(prompt.device)]))
    return out
