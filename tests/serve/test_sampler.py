"""The serving turn's one draw (`k3.serve.sampler`): every row by its own settings, as `k3.inference.generation`
samples one row; OpenAI's penalties; logprobs from the model's distribution; one draw a turn in the engine."""

from __future__ import annotations

import math

import pytest
import torch

from k3.inference.generation import sample, sampling_probs
from k3.serve import Sequence
from k3.serve.sampler import draw, draw_noise, filtered, sample_turn

from .conftest import poison_sampling
from .test_engine import Collector, alone, make_engine, prompts, tiny

V = 50


def rows_with(settings: list[dict]) -> list[Sequence]:
    rows = []
    for kw in settings:
        s = Sequence([1], 4, **kw)
        if s.seed is not None:
            s.generator = torch.Generator().manual_seed(s.seed)
        rows.append(s)
    return rows


SETTINGS = [
    {"temperature": 0.0},
    {"temperature": 0.7, "seed": 1},
    {"temperature": 1.3, "top_k": 5, "seed": 2},
    {"temperature": 1.0, "top_p": 0.6, "seed": 3},
    {"temperature": 0.9, "top_k": 7, "top_p": 0.8, "seed": 4},
    {"temperature": 1e-40},  # below float32's smallest normal: greedy
    {"temperature": 1.0, "top_k": 1, "seed": 5},
]


def test_each_row_draws_what_sample_draws_for_its_settings_and_seed():
    """A batch of rows, each with other settings, gets for every row the token `sample` draws for that row
    alone with a generator at the same seed (so a seeded request's tokens do not depend on its batch), over
    several turns; the filtered distributions equal `sampling_probs`'."""
    torch.manual_seed(0)
    rows = rows_with(SETTINGS)
    alone_generators = [None if s.seed is None else torch.Generator().manual_seed(s.seed) for s in rows]
    shared = torch.Generator().manual_seed(9)
    for _turn in range(5):
        logits = torch.randn(len(rows), V, dtype=torch.float64) * 3
        got = sample_turn(logits, rows, draw_noise(rows, V, "cpu", shared)).tokens
        for i, s in enumerate(rows):
            expected = sample(logits[i : i + 1], s.temperature, s.top_k, s.top_p, alone_generators[i])
            assert got[i] == expected.item(), (i, s.temperature, s.top_k, s.top_p)
    logits = torch.randn(len(rows), V)
    sampled = [i for i, s in enumerate(rows) if s.temperature > 1e-30]
    temperature = torch.tensor([rows[i].temperature for i in sampled])
    top_k = torch.tensor([rows[i].top_k or V for i in sampled])
    top_p = torch.tensor([rows[i].top_p or 1.0 for i in sampled])
    probs = filtered(logits[sampled], temperature, top_k, top_p).softmax(-1)
    for j, i in enumerate(sampled):
        s = rows[i]
        torch.testing.assert_close(probs[j : j + 1], sampling_probs(logits[i : i + 1], s.temperature, s.top_k, s.top_p))


def test_unseeded_rows_share_the_engines_generator_and_greedy_rows_draw_nothing():
    rows = rows_with([{"temperature": 0.0}, {"temperature": 0.0}])
    assert draw_noise(rows, V, "cpu", torch.Generator()) is None
    logits = torch.randn(2, V)
    assert sample_turn(logits, rows, None).tokens == logits.argmax(-1).tolist()
    rows = rows_with([{"temperature": 1.0}, {"temperature": 0.0}, {"temperature": 1.0}])
    noise = draw_noise(rows, V, "cpu", torch.Generator().manual_seed(0))
    expected = torch.empty(2, V).exponential_(generator=torch.Generator().manual_seed(0))
    assert torch.equal(noise[[0, 2]], expected) and torch.equal(noise[1], torch.ones(V))


def test_presence_and_frequency_penalties_are_openais():
    """z - presence * [count > 0] - frequency * count over the row's generated tokens; a row without
    penalties is untouched and keeps no counts."""
    rows = rows_with([{"temperature": 0.0, "presence_penalty": 1.5, "frequency_penalty": 0.5}, {"temperature": 0.0}])
    rows[0].tokens = [3, 3, 7]
    logits = torch.zeros(2, V)
    logits[:, 3], logits[:, 7], logits[:, 9] = 4.0, 2.5, 1.0
    # row 0: token 3 at 4 - 1.5 - 1.0 = 1.5, token 7 at 2.5 - 1.5 - 0.5 = 0.5, token 9 at 1.0: token 3 still
    assert sample_turn(logits, rows, None).tokens == [3, 3]
    assert rows[0].output_counts[3] == 3 and rows[0].output_counts[7] == 1 and rows[1].output_counts is None
    # now token 3 has count 3 (its draw counted): 4 - 1.5 - 1.5 = 1.0 ties token 9; raise it past
    logits[0, 9] = 1.2
    assert sample_turn(logits, rows, None).tokens == [9, 3]
    rows = rows_with([{"temperature": 0.0, "presence_penalty": -2.0}])
    rows[0].tokens = [5]
    logits = torch.zeros(1, V)
    logits[0, 6] = 1.0
    assert sample_turn(logits, rows, None).tokens == [5]  # a negative penalty favours what was said


def test_logprobs_are_the_models_distribution_before_temperature_and_penalties():
    rows = rows_with(
        [
            {"temperature": 0.0, "logprobs": 3},
            {"temperature": 2.0, "seed": 0, "logprobs": 0, "frequency_penalty": 2.0},
            {"temperature": 0.0},
        ]
    )
    logits = torch.randn(3, V, dtype=torch.float64)
    out = sample_turn(logits, rows, draw_noise(rows, V, "cpu", torch.Generator()))
    reference = logits.log_softmax(-1)
    assert out.asked == [0, 1]
    for j, i in enumerate(out.asked):
        assert math.isclose(out.chosen[j], reference[i, out.tokens[i]].item(), rel_tol=1e-6)
    values, ids = reference[0].topk(3)
    assert [t for t, _ in out.top[0]] == ids.tolist() and out.top[1] == []
    assert [lp for _, lp in out.top[0]] == pytest.approx(values.tolist())
    assert out.tokens[0] == ids[0].item()


def test_a_failing_draw_falls_back_to_rows_alone_and_fails_only_the_row_at_fault(monkeypatch):
    poison_sampling(monkeypatch, lambda s: s.top_k == 3, "poisoned")
    rows = rows_with([{"temperature": 0.0, "logprobs": 1}, {"temperature": 1.0, "top_k": 3}, {"temperature": 0.0}])
    failed = []
    logits = torch.randn(3, V)
    out = draw(logits, rows, torch.Generator(), lambda s, reason: failed.append((s, reason)))
    assert failed == [(rows[1], "error: RuntimeError: poisoned")]
    assert out.tokens[0] == logits[0].argmax().item() and out.tokens[2] == logits[2].argmax().item()
    assert len(rows[0].token_logprobs) == 1 and rows[2].token_logprobs == []


def test_sequence_refuses_penalties_and_logprobs_out_of_range():
    for kw in ({"presence_penalty": 2.5}, {"frequency_penalty": float("nan")}, {"logprobs": 21}, {"logprobs": -1}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            Sequence([1], 2, **kw)


def test_the_engine_draws_once_a_turn(monkeypatch):
    """Prefills ending and rows decoding in the same turns: at most one `sample_turn` call a turn, for all its
    rows together, and every sequence gets what it gets alone."""
    import k3.serve.sampler as sampler_module

    model = tiny("kimi-k3-tiny")
    engine = make_engine(model, prefill_chunk=8)
    turns, draws, real_turn, real_draw = [], [], engine._turn, sampler_module.sample_turn

    def turn():  # (draws this turn, whether rows were running at its start: then it must draw)
        before, running = len(draws), bool(engine.running)
        real_turn()
        turns.append((len(draws) - before, running))

    def counted(logits, rows, noise):
        draws.append(len(rows))
        return real_draw(logits, rows, noise)

    monkeypatch.setattr(engine, "_turn", turn)
    monkeypatch.setattr(sampler_module, "sample_turn", counted)
    engine.start()
    try:
        work = [(p, 3 + i % 4) for i, p in enumerate(prompts(6, seed=3))]
        collectors = [Collector() for _ in work]
        for (prompt, n), c in zip(work, collectors):
            engine.submit(c.sequence(prompt, n))
        for (prompt, n), c in zip(work, collectors):
            assert c.done.wait(120) and c.tokens == alone(model, prompt, n)
        assert all(n <= 1 for n, _ in turns) and all(n == 1 for n, running in turns if running)
        assert max(draws) > 1  # the rows of a turn drawn together
    finally:
        engine.stop()
