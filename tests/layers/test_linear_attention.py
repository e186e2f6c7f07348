"""The delta-rule layers: prefill-then-decode equals one full forward; gates as specified; names map."""

from __future__ import annotations

import pytest
import torch

from k3.layers.linear_attention import DeltaNet, GatedDeltaNet, KimiDeltaAttention
from k3.models.kinds import layer_cache

from .helpers import prefill_then_decode_error, run

LAYERS = {
    "deltanet": lambda: DeltaNet(24, 3, 8),
    "gated-deltanet": lambda: GatedDeltaNet(24, 3, 8),
    "kda": lambda: KimiDeltaAttention(24, 3, 8),
    "kda-k3": lambda: KimiDeltaAttention(24, 3, 8, kda_gate="safe", output_gate="full"),
}


def make(name):
    torch.manual_seed(0)
    layer = LAYERS[name]()
    layer.chunk_size = 16
    return layer


@pytest.mark.parametrize("name", LAYERS)
@pytest.mark.parametrize("prefix", [1, 5, 20, 37])
def test_prefill_then_decode_equals_full_forward(name, prefix):
    """Prefill `prefix` tokens through the chunk ops, then decode the rest one token at a time through
    the cache: the outputs equal one full forward (float32, relative 1e-4)."""
    layer = make(name)
    assert prefill_then_decode_error(layer, layer_cache(layer, 2), torch.randn(2, 40, 24), prefix) < 1e-4


@pytest.mark.parametrize("name", LAYERS)
def test_cache_size_is_constant(name):
    """The cache holds conv states and one [B, H, K, V] state, whatever the sequence length."""
    layer = make(name)
    sizes = []
    with torch.no_grad():
        cache = layer_cache(layer, 2)
        for T in (3, 50):
            run(layer, torch.randn(2, T, 24), cache)
            sizes.append(cache.nbytes())
    assert sizes[0] == sizes[1] == 4 * (3 * 2 * 24 * 3 + 2 * 3 * 8 * 8)


def test_gates_in_range():
    """Kimi Linear's gate is <= 0; Kimi K3's safe gate lies in [-5, 0]; Gated DeltaNet's is per head."""
    x = torch.randn(2, 9, 24) * 10
    g = make("kda").forget_gate(x)
    assert g.shape == (2, 9, 3, 8) and (g <= 0).all()
    g = make("kda-k3").forget_gate(x)
    assert (g >= -5).all() and (g <= 0).all()
    g = make("gated-deltanet").forget_gate(x)
    assert g.shape == (2, 9, 3) and (g <= 0).all()


def test_parameter_names_follow_kimi_linear():
    names = {n for n, _ in make("kda").named_parameters()}
    assert {
        "q_proj.weight",
        "q_conv1d.weight",
        "A_log",
        "dt_bias",
        "b_proj.weight",
        "f_a_proj.weight",
        "f_b_proj.weight",
        "g_a_proj.weight",
        "g_b_proj.weight",
        "o_norm.weight",
        "o_proj.weight",
    } <= names
    assert make("kda").A_log.shape == (1, 1, 3, 1) and make("kda").dt_bias.shape == (24,)
    assert "g_proj.weight" in {n for n, _ in make("kda-k3").named_parameters()}


def test_bad_input():
    layer = make("kda")
    with pytest.raises(ValueError, match="`x`"):
        layer(torch.randn(2, 5, 23))
    cache = layer_cache(layer, 2)
    with torch.no_grad():
        run(layer, torch.randn(2, 5, 24), cache)
    with pytest.raises(ValueError, match="batch size"):
        layer(torch.randn(3, 1, 24), cache=cache)
    with pytest.raises(ValueError, match="`kda_gate`"):
        KimiDeltaAttention(24, 3, 8, kda_gate="fast")
