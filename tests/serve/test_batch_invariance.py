"""The same tokens whatever the batch: random arrival schedules over the serving engine, for every tiny preset,
give each request the greedy tokens it gets alone, whatever runs beside it, whether its prefix was cached,
and wherever its prompt was cut into pieces.

A schedule (`schedule(seed)`) is a handful of requests, prompts of 1 to 300 tokens, half of them sharing a
prefix of an earlier one, each with a token limit and an engine turn it arrives at; and an engine: prefix
cache on or off, a prefill budget that cuts prompts at other places (16, 48 or 64 tokens a turn, or whole), a
pool of 4 to 16 rows. In float64 rounding cannot turn an argmax, so any difference is a row seeing another's
state, a wrong position or a lost piece. Each sequence keeps one row of the engine's pool and no cache's
rows are copied (`serve`). `make test` runs 2 schedules a preset, `make test-slow` 50;
`differing(preset, dtype, count)` counts the requests that differ in another dtype (float32: rounding may)."""

from __future__ import annotations

import random
from unittest import mock

import pytest
import torch

from k3.inference.cache import LayerCache
from k3.models import PRESETS, Cache, CausalLM, get_config
from k3.serve import Engine

from .test_engine import Collector, wait_until

TINY = [name for name in PRESETS if name.endswith("-tiny")]
LONGEST = 300  # prompt tokens at most
VOCAB = 97


def tiny_model(preset: str, dtype=torch.float64) -> CausalLM:
    torch.manual_seed(0)
    overrides = {"max_position_embeddings": 512} if preset == "gpt2-tiny" else {}
    return CausalLM(get_config(preset, vocab_size=VOCAB, hidden_size=32, **overrides)).to(dtype).eval()


def schedule(seed: int) -> tuple[list[tuple[list[int], int, int]], dict]:
    """(requests as (prompt, max_tokens, arrival turn), the engine's settings) drawn from `seed`."""
    g = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [g.randrange(VOCAB) for _ in range(n)]

    requests = []
    for _ in range(g.randint(3, 7)):
        if requests and g.random() < 0.5:  # a prefix of an earlier prompt, then its own tokens
            earlier = g.choice(requests)[0]
            cut = g.randint(1, len(earlier))
            prompt = (earlier[:cut] + tokens(g.randint(0, 40)))[:LONGEST]
        else:
            prompt = tokens(g.choice([g.randint(1, 12), g.randint(1, LONGEST)]))
        requests.append((prompt, g.randint(1, 6), g.randint(0, 5)))
    settings = dict(
        prefix_cache=g.random() < 0.5,
        prefill_chunk=g.choice([16, 48, 64, 0]),
        max_running=g.choice([4, 8, 16]),
    )
    return requests, settings


def copying(*args, **kw):
    raise AssertionError("a cache's rows were copied on the serving path")


def serve(model, requests, settings) -> list[list[int]]:
    """Each request's tokens from one engine, each submitted once the engine has decoded `arrival` turns
    (or has nothing left to do). The engine holds one pool: a sequence keeps one row from its first token
    to its last, and no cache's rows are copied or joined (a copy fails the sequence)."""
    engine = Engine(model, cache_memory=10**9, max_length=LONGEST + 8, **settings).start()
    rows: dict[int, set] = {}
    try:
        with (
            mock.patch.object(Cache, "concat", copying),
            mock.patch.object(Cache, "copy_row", copying),
            mock.patch.object(LayerCache, "copy_row", copying),
        ):
            collectors = [Collector() for _ in requests]
            for (prompt, n, arrival), c in sorted(zip(requests, collectors), key=lambda pair: pair[0][2]):
                wait_until(lambda: engine.steps >= arrival or engine.stats()["running"] == 0)
                sequence = c.sequence(prompt, n)
                keep = sequence.on_token
                sequence.on_token = lambda t, s=sequence, keep=keep: rows.setdefault(s.id, set()).add(s.row) or keep(t)
                engine.submit(sequence)
            for c in collectors:
                assert c.done.wait(300) and c.reason == "length", c.reason
        assert all(len(held) == 1 for held in rows.values()), rows  # one row each, never moved
        return [c.tokens for c in collectors]
    finally:
        engine.stop()


def alone(model, prompt: list[int], n: int) -> list[int]:
    return model.generate([prompt], n, temperature=0)[0][len(prompt) :].tolist()


def differing(preset: str, dtype=torch.float32, schedules: int = 50) -> tuple[int, int]:
    """(requests whose tokens differ from alone, requests) over `schedules` schedules in `dtype`."""
    model, bad, total = tiny_model(preset, dtype), 0, 0
    for seed in range(schedules):
        requests, settings = schedule(seed)
        got = serve(model, requests, settings)
        for (prompt, n, _), tokens in zip(requests, got):
            bad += tokens != alone(model, prompt, n)
            total += 1
    return bad, total


def check_schedules(preset: str, seeds) -> None:
    model = tiny_model(preset)
    for seed in seeds:
        requests, settings = schedule(seed)
        got = serve(model, requests, settings)
        for i, ((prompt, n, arrival), tokens) in enumerate(zip(requests, got)):
            assert tokens == alone(model, prompt, n), (seed, settings, i, len(prompt), arrival)


@pytest.mark.parametrize("preset", TINY)
def test_each_request_gets_its_tokens_alone_whatever_the_schedule(preset):
    check_schedules(preset, range(2))


@pytest.mark.slow
@pytest.mark.parametrize("preset", TINY)
def test_fifty_schedules_each_request_as_alone(preset):
    check_schedules(preset, range(50))
