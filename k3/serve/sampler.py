"""Sampling a serving turn: one call for every row that gets a token this turn, each row with its own
settings, as vLLM's sampler takes a batch.

For the rows' logits z [B, V] and per-row tensors of their settings, the rule `k3.inference.generation`
states for one row (`sampling_probs`, `sample_with_noise`), batched:

    z'  = z - presence * [count > 0] - frequency * count          (OpenAI's penalties, over the row's output)
    greedy rows (temperature 0):  token = argmax z'
    the others:  l = (z' - max z') / temperature; drop l < l_(k) (top_k), then the tail whose ranked
                 probability mass before it reaches top_p (top_p); p = softmax(l); token = argmax p / E

with E ~ Exponential(1) noise [B, V] drawn before the call: a seeded row's from its own generator (so its
tokens do not depend on what else runs, and equal `k3 generate`'s for that seed), the others' in one draw
from the engine's. Nothing is sorted unless a sampled row has top_k or top_p; nothing is penalised unless a
row asks. A row that asks for `logprobs` gets its token's log-probability and its `logprobs` most likely
alternatives, from log_softmax z, the model's distribution before penalties and temperature (vLLM's default,
"raw_logprobs"). Only the chosen tokens and what `logprobs` asked for leave the device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..inference.generation import _HOTTEST, GREEDY_BELOW, is_greedy

log = logging.getLogger("k3.serve")


@dataclass
class Draw:
    """A turn's draw: `tokens` [B]; for the rows that asked for logprobs (`asked`, their row indices), the
    chosen token's log-probability and the top alternatives, as host lists in `asked`'s order."""

    tokens: list[int]
    asked: list[int]
    chosen: list[float]
    top: list[list[tuple[int, float]]]


def draw_noise(rows, vocab_size: int, device, generator: torch.Generator) -> torch.Tensor | None:
    """Exponential(1) noise [B, V] for the sampled rows of `rows` (Sequences; the greedy rows' stay 1), or
    None when every row is greedy: a seeded row's from its own generator, the rest in one draw from
    `generator`."""
    sampled = [i for i, s in enumerate(rows) if not is_greedy(s.temperature)]
    if not sampled:
        return None
    noise = torch.ones(len(rows), vocab_size, device=device)
    shared = [i for i in sampled if rows[i].generator is None]
    for i in sampled:
        if rows[i].generator is not None:
            noise[i].exponential_(generator=rows[i].generator)
    if shared:
        draws = torch.empty(len(shared), vocab_size, device=device).exponential_(generator=generator)
        noise[shared] = draws
    return noise


def penalise(logits: torch.Tensor, rows) -> torch.Tensor:
    """logits [B, V] (float32) with each row's presence and frequency penalties over the tokens it has
    generated (`output_counts`, kept on the device): unchanged when no row asks."""
    penalised = [i for i, s in enumerate(rows) if s.presence_penalty or s.frequency_penalty]
    if not penalised:
        return logits
    counts = torch.stack([output_counts(rows[i], logits) for i in penalised])
    presence = logits.new_tensor([rows[i].presence_penalty for i in penalised])[:, None]
    frequency = logits.new_tensor([rows[i].frequency_penalty for i in penalised])[:, None]
    logits = logits.clone()
    logits[penalised] -= presence * (counts > 0) + frequency * counts
    return logits


def output_counts(sequence, like: torch.Tensor) -> torch.Tensor:
    """[V] how often each token occurs in what `sequence` has generated, made from its tokens the first time
    and kept up to date by `sample_turn`, which counts each token it draws."""
    if sequence.output_counts is None:
        counts = like.new_zeros(like.shape[-1])
        if sequence.tokens:
            counts.index_add_(0, torch.tensor(sequence.tokens, device=like.device), like.new_ones(len(sequence.tokens)))
        sequence.output_counts = counts
    return sequence.output_counts


def filtered(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor):
    """`sampling_probs`' logits for every row at once: (z - max) / temperature, then each row's top_k and
    top_p, dropped tokens at -inf. `top_k` [B] (V: none), `top_p` [B] (1: none)."""
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature.clamp(max=_HOTTEST)[:, None]
    V = logits.shape[-1]
    narrowed = bool((top_k < V).any())
    nucleus = bool((top_p < 1).any())
    if not (narrowed or nucleus):
        return logits
    ranked, order = logits.sort(dim=-1, descending=True)
    if narrowed:
        kth = ranked.gather(-1, (top_k - 1)[:, None])
        ranked = ranked.masked_fill(ranked < kth, float("-inf"))
    if nucleus:
        probs = ranked.softmax(-1)
        # a token drops when those ranked above it reach top_p; the first always stays; top_p 1 drops nothing
        reach = torch.where(top_p < 1, top_p, torch.inf)[:, None]
        drop = probs.cumsum(-1) - probs >= reach
        drop[..., 0] = False
        ranked = ranked.masked_fill(drop, float("-inf"))
    return logits.scatter(-1, order, ranked)


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, alternatives: list[int]):
    """From logits [n, V], the model's distribution log_softmax: row j's log-probability of tokens[j] and its
    `alternatives[j]` likeliest (token, log-probability) pairs, as host lists."""
    logprobs = logits.float().log_softmax(-1)
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0].tolist()
    values, ids = logprobs.topk(min(max(alternatives, default=0), logprobs.shape[-1]), dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return chosen, [list(zip(ids[j][:k], values[j][:k])) for j, k in enumerate(alternatives)]


def sample_turn(logits: torch.Tensor, rows, noise: torch.Tensor | None) -> Draw:
    """The turn's tokens for `rows` (Sequences, one per row of `logits` [B, V]) with `noise`
    (`draw_noise`); see the module docstring."""
    raw = logits.float()
    z = penalise(raw, rows)
    tokens = z.argmax(-1)
    if noise is not None:
        sampled = torch.tensor([not is_greedy(s.temperature) for s in rows], device=z.device)
        temperature = z.new_tensor([s.temperature if not is_greedy(s.temperature) else 1.0 for s in rows])
        V = z.shape[-1]
        top_k = torch.tensor([min(s.top_k or V, V) for s in rows], device=z.device)
        top_p = z.new_tensor([1.0 if s.top_p is None else float(s.top_p) for s in rows])
        probs = filtered(z, temperature, top_k, top_p).softmax(-1)
        drawn = (probs / noise.clamp_min(GREEDY_BELOW)).argmax(-1)
        tokens = torch.where(sampled, drawn, tokens)
    asked = [i for i, s in enumerate(rows) if s.logprobs is not None]
    chosen, top = logprobs_of(raw[asked], tokens[asked], [rows[i].logprobs for i in asked]) if asked else ([], [])
    out = tokens.tolist()
    for i, s in enumerate(rows):
        if s.output_counts is not None:
            s.output_counts[out[i]] += 1
    return Draw(out, asked, chosen, top)


def draw(logits: torch.Tensor, rows, generator: torch.Generator, fail) -> Draw:
    """The serving engine's one draw a turn: `sample_turn` over `rows` with their noise, each asking row's
    logprobs appended to its `token_logprobs`. Should the draw raise, each row draws alone (with the noise
    drawn for it), so that only a row at fault ends: `fail(sequence, "error: ...")` and a line in the log;
    its token is a placeholder the engine skips."""
    V, device, noise = logits.shape[-1], logits.device, None
    try:
        noise = draw_noise(rows, V, device, generator)
        out = sample_turn(logits, rows, noise)
    except Exception as e:
        log.warning("k3 serve: sampling %d rows failed (%s: %s); each draws alone", len(rows), type(e).__name__, e)
        out = Draw([], [], [], [])
        for i, sequence in enumerate(rows):
            try:
                one = draw_noise([sequence], V, device, generator) if noise is None else noise[i : i + 1]
                alone = sample_turn(logits[i : i + 1], [sequence], one)
            except Exception as e:
                log.error("k3 serve: sequence %d failed to sample: %s: %s", sequence.id, type(e).__name__, e)
                fail(sequence, f"error: {type(e).__name__}: {e}")
                alone = Draw([0], [], [], [])
            out.tokens += alone.tokens
            out.asked += [i] * len(alone.asked)
            out.chosen += alone.chosen
            out.top += alone.top
    for i, chosen, top in zip(out.asked, out.chosen, out.top):
        rows[i].token_logprobs.append((chosen, top))
    return out
