"""count_params and the kinds' formulas against real modules and caches, the published figures, and
`k3 params`."""

from __future__ import annotations

import pytest
import torch

from k3.cli import main
from k3.models import CausalLM, count_params, get_config
from k3.models.kinds import MIXERS

from .conftest import TINY, tiny_model


@pytest.mark.parametrize("name", TINY)
def test_count_equals_real_module_tiny(name):
    config = get_config(name)
    pc = count_params(config)
    assert pc.total == CausalLM(config).num_parameters()
    assert sum(pc.breakdown.values()) == pc.total


@pytest.mark.parametrize("name", ["gpt2", "linear-attn", "deltanet", "gated-deltanet", "kimi-linear", "kimi-k3"])
def test_count_equals_module_built_on_meta(name):
    config = get_config(name)
    with torch.device("meta"):
        model = CausalLM(config)
    assert count_params(config).total == model.num_parameters()


def test_gpt2_is_exactly_124_475_904():
    assert count_params(get_config("gpt2")).total == 124_475_904
    assert count_params(get_config("gpt2", vocab_size=50257)).total == 124_439_808


def test_kimi_k3_within_one_percent_of_published():
    pc = count_params(get_config("kimi-k3"))
    assert abs(pc.total / 2.8e12 - 1) < 0.01 and abs(pc.active / 104e9 - 1) < 0.01
    assert pc.mla_cache_bytes_per_token == 24 * 576 * 2  # 24 MLA layers, 512 + 64 values, bf16
    article = count_params(get_config("kimi-k3-article"))
    assert 2.74e12 < article.total < pc.total


def test_active_counts_only_chosen_experts():
    c = get_config("kimi-linear-tiny")
    pc = count_params(c)
    per_expert = 3 * c.hidden_size * c.moe_intermediate_size
    moe_layers = c.mlp_types.count("moe")
    lookup = c.vocab_size * c.hidden_size
    assert pc.total - pc.active == moe_layers * (c.num_experts - c.num_experts_per_tok) * per_expert + lookup


def test_k3_params_cli(capsys):
    assert main(["params", "kimi-k3", "--vs", "gpt2"]) == 0
    out = capsys.readouterr().out
    assert "2,779,484,393,568" in out and "22,329.50" in out and "22,580" in out
    assert main(["params", "nope"]) == 2
    assert "choose from" in capsys.readouterr().err


@pytest.mark.parametrize("name", TINY)
def test_cache_bytes_of_every_kind_equal_a_real_cache(name):
    """Each mixer kind's byte formulas (k3.models.kinds: per token and per sequence) equal what its layers'
    caches hold after a prefill, at 4 bytes per value (a float32 model); count_params' figures sum them."""
    model = tiny_model(name)
    c = model.config
    cache = model.new_cache(2)
    with torch.no_grad():
        model(torch.zeros(2, 9, dtype=torch.long), cache=cache)
    want: dict[str, int] = {}
    for kind in c.layer_types:
        want[kind] = want.get(kind, 0) + 2 * (
            MIXERS[kind].cache_bytes_per_token(c, 4) * 9 + MIXERS[kind].state_bytes(c, 4)
        )
    assert cache.nbytes_by_type(held=True) == want
    pc = count_params(c, cache_dtype_bytes=4)
    assert 2 * (
        pc.mla_cache_bytes_per_token + pc.kv_cache_bytes_per_token
    ) * 9 + 2 * pc.recurrent_state_bytes_per_sequence == cache.nbytes(held=True)
