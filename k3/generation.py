"""Sampling and generation through the hybrid cache: one chunked prefill, then one recurrent step per token."""

from __future__ import annotations

from typing import Iterator

import torch


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] -> token ids [B]. temperature 0 is greedy; top_k keeps the k most likely tokens,
    top_p the smallest set whose probability reaches p (nucleus); both apply before sampling."""
    if temperature < 0:
        raise ValueError(f"sample: `temperature` must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"sample: `top_k` must be >= 1 or None, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"sample: `top_p` must be in (0, 1] or None, got {top_p}")
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p (the first one always stays)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def stream(model, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
           top_p: float | None = None, eos_token_id: int | None = None,
           generator: torch.Generator | None = None) -> Iterator[torch.Tensor]:
    """Yield the next token [B] of every sequence, max_new_tokens times or until all have emitted
    eos_token_id (a finished sequence keeps yielding eos)."""
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"generate: the prompt `input_ids` must be [B, T] with T >= 1, got {list(input_ids.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"generate: `max_new_tokens` must be >= 0, got {max_new_tokens}")
    cache = model.new_cache(input_ids.shape[0])
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    logits = model(input_ids, cache=cache)[:, -1]
    for step in range(max_new_tokens):
        token = sample(logits, temperature, top_k, top_p, generator)
        if eos_token_id is not None:
            token = token.masked_fill(done, eos_token_id)
            done |= token == eos_token_id
        yield token
        if eos_token_id is not None and bool(done.all()):
            return
        if step + 1 < max_new_tokens:
            logits = model(token.unsqueeze(1), cache=cache)[:, -1]


def generate(model, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, eos_token_id: int | None = None,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """Prompt [B, T] -> prompt and new tokens [B, T + n], n <= max_new_tokens."""
    new = list(stream(model, input_ids, max_new_tokens, temperature, top_k, top_p, eos_token_id, generator))
    return torch.cat([input_ids, torch.stack(new, dim=1)], dim=1) if new else input_ids.clone()
