"""k3.bench.timing: the one `interleaved_best` (its warm-up, cold cases, gradients and clock), `threads`,
and the inputs `k3 bench ops` times."""

from __future__ import annotations

import pytest
import torch

from k3.bench.ops import kda_inputs
from k3.bench.timing import interleaved_best, threads


def logged_cases(names="abc"):
    log = []

    def case(name):
        def run():
            log.append((name, torch.is_grad_enabled()))

        return run

    return log, {name: case(name) for name in names}


def test_inline_warmup_comes_right_before_each_first_timed_call_and_skips_cold_cases():
    log, cases = logged_cases()
    interleaved_best(cases, rounds=2, cold=frozenset("b"))
    assert [name for name, _ in log] == ["a", "a", "b", "c", "c", "a", "b", "c"]
    assert not any(grad for _, grad in log)  # grad=False: everything under no_grad


def test_ahead_warmup_calls_every_case_before_the_first_round_with_autograd_as_given():
    log, cases = logged_cases()
    interleaved_best(cases, rounds=2, warmup="ahead", grad=True)
    assert [name for name, _ in log] == ["a", "b", "c"] * 3
    assert all(grad for _, grad in log)


def test_each_case_keeps_its_fastest_round_on_the_given_clock():
    durations = {"a": [5, 2, 7], "b": [1, 3, 1]}
    now = [0]

    def clock():
        return now[0]

    def case(name):
        calls = iter(durations[name])

        def run():
            now[0] += next(calls)

        return run

    best = interleaved_best(
        {name: case(name) for name in durations}, rounds=3, warmup="ahead", cold=frozenset("ab"), clock=clock
    )
    assert best == {"a": 2, "b": 1}
    with pytest.raises(ValueError, match="`warmup` must be one of"):
        interleaved_best({}, rounds=1, warmup="before")


def test_threads_sets_and_restores_the_count():
    before = torch.get_num_threads()
    with threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_kda_inputs_are_seeded_with_the_safe_gate():
    q, k, v, g, beta = kda_inputs(T=5, H=2, d=4)
    assert q.shape == k.shape == v.shape == g.shape == (1, 5, 2, 4) and beta.shape == (1, 5, 2)
    assert torch.allclose(k.norm(dim=-1), torch.ones(1, 5, 2))
    assert ((g < 0) & (g > -5)).all() and ((beta > 0) & (beta < 1)).all()
    assert torch.equal(kda_inputs(5, 2, 4)[0], q) and not torch.equal(kda_inputs(5, 2, 4, seed=1)[0], q)
