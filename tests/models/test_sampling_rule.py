"""One sampling rule for eager and compiled decoding (issue 46, point 5): the same validated ranges, the same
tokens for the same seed, and every value in range finite — temperatures and top_p too small to matter are the
limit they approach (greedy), never a NaN draw, an all-zero distribution or token 0 by accident."""

from __future__ import annotations

import math

import pytest
import torch

from k3.inference.generation import (
    MAX_SEED,
    check_sampling,
    check_seed,
    is_greedy,
    sample,
    sample_with_noise,
    sampling_probs,
)

from .conftest import tiny_model

UNDERFLOWING = [(1e-300, None), (5e-324, None), (1.0, 1e-300), (0.7, 5e-324), (1e-45, 1e-45)]


def _logits(B: int = 3, V: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * 4


@pytest.mark.parametrize("temperature, top_p", UNDERFLOWING)
def test_underflowing_settings_are_greedy(temperature, top_p):
    logits = _logits()
    greedy = logits.argmax(-1)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        assert torch.equal(sample(logits, temperature, top_p=top_p, generator=g), greedy)
    if not is_greedy(temperature):
        probs = sampling_probs(logits, temperature, None, top_p)
        assert bool(torch.isfinite(probs).all())
        torch.testing.assert_close(probs.sum(-1), torch.ones(3))


def test_huge_temperature_is_finite_and_near_uniform():
    logits = _logits(B=1, V=8)
    for temperature in (1e30, 1e300):
        probs = sampling_probs(logits, temperature)
        torch.testing.assert_close(probs, torch.full((1, 8), 1 / 8))


def test_a_zero_clock_never_picks_a_dropped_token():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    noise = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # token 3 outside top_k rings at once
    assert sample_with_noise(logits, noise, 1.0, top_k=2).item() in (0, 1)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, "1", True, None])
def test_temperature_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="`temperature`"):
        check_sampling(bad)


@pytest.mark.parametrize("bad", [0, -0.5, 1.5, math.nan, "0.5", True])
def test_top_p_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="`top_p`"):
        check_sampling(1.0, None, bad)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_top_k_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="`top_k`"):
        check_sampling(1.0, bad)


@pytest.mark.parametrize("bad", [-1, MAX_SEED + 1, 2**64, 1.5, "3", True])
def test_seed_outside_the_generators_range_is_refused(bad):
    with pytest.raises(ValueError, match=r"`--seed` must be an int in \[0, 2\*\*64 - 1\]"):
        check_seed(bad, "--seed")


def test_every_seed_in_range_seeds_a_generator():
    for seed in (None, 0, 1, MAX_SEED):
        check_seed(seed)
        if seed is not None:
            torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("name", ["kimi-k3-tiny", "gpt2-tiny"])
def test_eager_and_compiled_draw_the_same_tokens_for_one_seed(name):
    torch._dynamo.reset()
    model = tiny_model(name).double()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    kwargs = dict(temperature=0.9, top_k=40, top_p=0.95)
    eager = model.generate(prompts, 8, generator=torch.Generator().manual_seed(7), **kwargs)
    compiled = model.generate(prompts, 8, generator=torch.Generator().manual_seed(7), compile="aot_eager", **kwargs)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
    other = model.generate(prompts, 8, generator=torch.Generator().manual_seed(8), **kwargs)
    assert any(not torch.equal(a, b) for a, b in zip(eager, other))  # the seed matters


@pytest.mark.parametrize("temperature, top_p", UNDERFLOWING[:3])
def test_eager_and_compiled_are_greedy_alike_at_underflowing_settings(temperature, top_p):
    torch._dynamo.reset()
    model = tiny_model("kimi-k3-tiny").double()
    ids = torch.tensor([[5, 6, 7, 8]])
    greedy = model.generate(ids, 6, temperature=0)
    for compile in (False, "aot_eager"):
        got = model.generate(
            ids, 6, temperature=temperature, top_p=top_p, generator=torch.Generator().manual_seed(0), compile=compile
        )
        assert torch.equal(got, greedy), compile
