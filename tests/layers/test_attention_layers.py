"""GPT-2 attention and ELU+1 linear attention: prefill-then-decode == one forward; cache sizes."""

from __future__ import annotations

import math

import pytest
import torch

from k3.layers import LinearAttention, MultiHeadAttention
from k3.models.kinds import layer_cache

from .helpers import prefill_then_decode_error


@pytest.mark.parametrize("prefix", [1, 7, 20])
def test_mha_prefill_then_decode(prefix):
    torch.manual_seed(0)
    layer = MultiHeadAttention(24, 4)
    cache = layer_cache(layer, 2)
    assert prefill_then_decode_error(layer, cache, torch.randn(2, 30, 24), prefix) < 1e-5
    assert cache.nbytes() == 2 * 2 * cache.owner.capacity * 24 * 4  # k and v, batch 2, every slot, float32


def test_mha_matches_naive_softmax():
    torch.manual_seed(1)
    layer = MultiHeadAttention(12, 3).double()
    x = torch.randn(1, 9, 12, dtype=torch.float64)
    q, k, v = (t.view(1, 9, 3, 4).transpose(1, 2) for t in layer.c_attn(x).split(12, -1))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(4)
    scores = scores.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
    o = (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, 9, 12)
    torch.testing.assert_close(layer(x), layer.c_proj(o))
    with pytest.raises(ValueError, match="divisible"):
        MultiHeadAttention(10, 3)


@pytest.mark.parametrize("prefix", [1, 7, 20])
def test_linear_attention_prefill_then_decode(prefix):
    torch.manual_seed(2)
    layer = LinearAttention(24, 3, 8, chunk_size=8)
    cache = layer_cache(layer, 2)
    assert prefill_then_decode_error(layer, cache, torch.randn(2, 30, 24), prefix) < 1e-5
    assert cache.nbytes() == 4 * (2 * 3 * 8 * 8 + 2 * 3 * 8)  # S and z, independent of T
