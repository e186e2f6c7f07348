"""Synthetic recall tasks: multi-query associative recall (MQAR, as in Zoology), re-bound keys, context switches.

A sequence is a run of tokens; the model reads `inputs` and is scored only where `targets` is not IGNORE. The
vocabulary is laid out as

    0 PAD (filler)   1 SWITCH (context switch)   2 NONE ("no binding")   keys [3, 3+K)   values [3+K, 3+K+V)

MQAR:      k1 v1 k2 v2 ... kP vP  PAD...PAD  q1 a1 q2 a2 ...     (each qi one of the kj, ai = vj)
overwrite: k1 v1 ... kP vP  then R of the keys again with new values  ...  queries; the answer is the LATEST value
switch:    bindings A  SWITCH  bindings B  queries; keys bound in B answer B's value, keys bound only in A answer
           NONE: what came before the switch must be dropped.

Targets sit on the query key (the model must predict the answer from the key), so an answer is never visible to
the prediction that must produce it: its only earlier occurrence is in the binding (tests check this).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100
PAD, SWITCH, NONE = 0, 1, 2
FIRST_KEY = 3


@dataclass(frozen=True)
class Vocab:
    num_keys: int = 64
    num_values: int = 64

    @property
    def size(self) -> int:
        return FIRST_KEY + self.num_keys + self.num_values

    @property
    def first_value(self) -> int:
        return FIRST_KEY + self.num_keys


@dataclass
class Batch:
    """inputs/targets [B, T] (targets IGNORE except at query keys); `kind` [B, T] tags each scored position
    (see the task's KINDS) so accuracy can be split by what the query tests."""

    inputs: torch.Tensor
    targets: torch.Tensor
    kind: torch.Tensor


def _check(name: str, value: int, low: int, high: int | None = None) -> None:
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bound}, got {value}")


def _distinct(generator: torch.Generator, batch: int, population: int, count: int, offset: int) -> torch.Tensor:
    """[batch, count] distinct draws from range(offset, offset + population), per row."""
    return torch.rand(batch, population, generator=generator).argsort(dim=1)[:, :count] + offset


def _place_queries(seq, targets, kind, keys, answers, kinds, start: int) -> None:
    """Write `q a` pairs from position `start` on; the target sits on the query key."""
    n = keys.shape[1]
    pos = start + 2 * torch.arange(n)
    seq[:, pos], seq[:, pos + 1] = keys, answers
    targets[:, pos], kind[:, pos] = answers, kinds


def mqar(
    batch: int,
    seq_len: int,
    num_pairs: int,
    vocab: Vocab = Vocab(),
    num_queries: int | None = None,
    generator: torch.Generator | None = None,
) -> Batch:
    """Multi-query associative recall: `num_pairs` distinct keys bound to random values, then `num_queries`
    (default: all of them, in random order) asked at the end of the sequence, after PAD filler."""
    num_queries = num_pairs if num_queries is None else num_queries
    _check("num_pairs", num_pairs, 1, vocab.num_keys)
    _check("num_queries", num_queries, 1, num_pairs)
    _check("seq_len", seq_len, 2 * num_pairs + 2 * num_queries - 1)
    g = generator or torch.Generator().manual_seed(0)
    keys = _distinct(g, batch, vocab.num_keys, num_pairs, FIRST_KEY)
    values = torch.randint(vocab.first_value, vocab.size, (batch, num_pairs), generator=g)
    seq = torch.full((batch, seq_len + 1), PAD, dtype=torch.long)
    seq[:, 0 : 2 * num_pairs : 2], seq[:, 1 : 2 * num_pairs : 2] = keys, values
    targets, kind = torch.full_like(seq, IGNORE), torch.zeros_like(seq)
    asked = torch.rand(batch, num_pairs, generator=g).argsort(dim=1)[:, :num_queries]
    start = seq_len + 1 - 2 * num_queries
    _place_queries(seq, targets, kind, keys.gather(1, asked), values.gather(1, asked), torch.ones_like(asked), start)
    return Batch(seq[:, :-1], targets[:, :-1], kind[:, :-1])


OVERWRITE_KINDS = {1: "kept (bound once)", 2: "re-bound (latest value)"}


def overwrite(
    batch: int,
    seq_len: int,
    num_pairs: int,
    num_rebound: int,
    vocab: Vocab = Vocab(),
    generator: torch.Generator | None = None,
) -> Batch:
    """`num_pairs` bindings, then `num_rebound` of those keys bound again to new values; every key is then
    queried and must answer its latest value. kind 1: a key bound once, kind 2: a re-bound key."""
    _check("num_pairs", num_pairs, 1, vocab.num_keys)
    _check("num_rebound", num_rebound, 0, num_pairs)
    _check("vocab.num_values", vocab.num_values, 2)
    _check("seq_len", seq_len, 4 * num_pairs + 2 * num_rebound - 1)
    g = generator or torch.Generator().manual_seed(0)
    keys = _distinct(g, batch, vocab.num_keys, num_pairs, FIRST_KEY)
    old = torch.randint(vocab.first_value, vocab.size, (batch, num_pairs), generator=g)
    # a new value that differs from the old one, so recalling the stale binding is always wrong
    shift = torch.randint(1, vocab.num_values, (batch, num_pairs), generator=g)
    new = (old - vocab.first_value + shift) % vocab.num_values + vocab.first_value
    order = torch.rand(batch, num_pairs, generator=g).argsort(dim=1)
    rebound = order[:, :num_rebound]  # which bindings change
    seq = torch.full((batch, seq_len + 1), PAD, dtype=torch.long)
    seq[:, 0 : 2 * num_pairs : 2], seq[:, 1 : 2 * num_pairs : 2] = keys, old
    at = 2 * num_pairs
    seq[:, at : at + 2 * num_rebound : 2] = keys.gather(1, rebound)
    seq[:, at + 1 : at + 2 * num_rebound : 2] = new.gather(1, rebound)
    latest, kinds = old.clone(), torch.ones_like(old)
    latest.scatter_(1, rebound, new.gather(1, rebound))
    kinds.scatter_(1, rebound, torch.full_like(rebound, 2))
    asked = torch.rand(batch, num_pairs, generator=g).argsort(dim=1)
    targets, kind = torch.full_like(seq, IGNORE), torch.zeros_like(seq)
    _place_queries(
        seq,
        targets,
        kind,
        keys.gather(1, asked),
        latest.gather(1, asked),
        kinds.gather(1, asked),
        seq_len + 1 - 2 * num_pairs,
    )
    return Batch(seq[:, :-1], targets[:, :-1], kind[:, :-1])


SWITCH_KINDS = {1: "current (bound after the switch)", 2: "stale (bound only before: answer NONE)"}


def context_switch(
    batch: int, seq_len: int, num_pairs: int, vocab: Vocab = Vocab(), generator: torch.Generator | None = None
) -> Batch:
    """Bindings A (`num_pairs`), SWITCH, bindings B (`num_pairs`, drawn afresh so some keys repeat with new values),
    then queries: every key of B (answer: its B value) and as many keys bound only in A (answer: NONE), shuffled.
    kind 1: a current key, kind 2: a stale key."""
    _check("num_pairs", num_pairs, 1, vocab.num_keys // 2)
    g = generator or torch.Generator().manual_seed(0)
    keys_a = _distinct(g, batch, vocab.num_keys, num_pairs, FIRST_KEY)
    keys_b = _distinct(g, batch, vocab.num_keys, num_pairs, FIRST_KEY)
    values_a = torch.randint(vocab.first_value, vocab.size, (batch, num_pairs), generator=g)
    values_b = torch.randint(vocab.first_value, vocab.size, (batch, num_pairs), generator=g)
    # keys bound only in A, per row: rank A's keys by whether B rebinds them, stale ones first
    in_b = (keys_a[:, :, None] == keys_b[:, None, :]).any(-1)
    stale_first = (in_b.float() + torch.rand(batch, num_pairs, generator=g)).argsort(dim=1)
    num_stale = int((~in_b).sum(1).min())  # the same count in every row keeps the batch rectangular
    stale = keys_a.gather(1, stale_first[:, :num_stale])
    queries = torch.cat([keys_b, stale], 1)
    answers = torch.cat([values_b, torch.full_like(stale, NONE)], 1)
    kinds = torch.cat([torch.ones_like(keys_b), torch.full_like(stale, 2)], 1)
    n_q = queries.shape[1]
    _check("seq_len", seq_len, 4 * num_pairs + 2 * n_q)
    shuffle = torch.rand(batch, n_q, generator=g).argsort(dim=1)
    seq = torch.full((batch, seq_len + 1), PAD, dtype=torch.long)
    seq[:, 0 : 2 * num_pairs : 2], seq[:, 1 : 2 * num_pairs : 2] = keys_a, values_a
    seq[:, 2 * num_pairs] = SWITCH
    b0 = 2 * num_pairs + 1
    seq[:, b0 : b0 + 2 * num_pairs : 2], seq[:, b0 + 1 : b0 + 2 * num_pairs : 2] = keys_b, values_b
    targets, kind = torch.full_like(seq, IGNORE), torch.zeros_like(seq)
    _place_queries(
        seq,
        targets,
        kind,
        queries.gather(1, shuffle),
        answers.gather(1, shuffle),
        kinds.gather(1, shuffle),
        seq_len + 1 - 2 * n_q,
    )
    return Batch(seq[:, :-1], targets[:, :-1], kind[:, :-1])
