"""Causal softmax attention: a naive masked-softmax reference, the KV cache as state, K != V."""

from __future__ import annotations

import pytest
import torch

from k3.ops import attention, l2norm

from .helpers import TOL_F32, TOL_F64, assert_rel


def naive_attention(q, k, v, scale, past=0):
    """o_i = sum_{j <= past + i} softmax_j(scale q_i . k_j) v_j, written out with an explicit mask
    (float64). q [B, T, H, K]; k [B, past + T, H, K]; v [B, past + T, H, V]."""
    T, L = q.shape[1], k.shape[1]
    scores = torch.einsum("bthk,bshk->bhts", q.double(), k.double()) * scale
    allowed = torch.ones(T, L, dtype=torch.bool).tril(past)
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("bhts,bshv->bthv", weights, v.double())


def qkv(B=2, T=20, H=3, K=12, V=7, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return tuple(torch.randn(B, T, H, d, dtype=torch.float64).to(dtype) for d in (K, K, V))


@pytest.mark.parametrize("T", [1, 5, 33])
@pytest.mark.parametrize("K,V", [(12, 7), (8, 8), (4, 20)])
def test_matches_naive_softmax_reference(T, K, V):
    """float64: attention == explicit causal masked softmax, default scale K**-0.5, K != V; the final
    state is the (k, v) cache."""
    q, k, v = qkv(T=T, K=K, V=V, seed=T + K)
    o, (k_all, v_all) = attention(q, k, v, output_final_state=True)
    assert o.shape == (2, T, 3, V) and o.dtype == torch.float64
    assert_rel(o, naive_attention(q, k, v, K**-0.5), TOL_F64, "o")
    assert torch.equal(k_all, k) and torch.equal(v_all, v)
    o_none, state = attention(q, k, v)
    assert state is None
    assert torch.equal(o_none, o)


def test_causality():
    """Changing the future tokens (k, v at positions > t) leaves the outputs up to t unchanged."""
    q, k, v = qkv(T=16)
    o, _ = attention(q, k, v)
    k2, v2 = k.clone(), v.clone()
    k2[:, 9:] += 5.0
    v2[:, 9:] -= 3.0
    o2, _ = attention(q, k2, v2)
    assert torch.equal(o2[:, :9], o[:, :9])
    assert not torch.allclose(o2[:, 9:], o[:, 9:])


def test_scale_and_qk_l2norm():
    """An explicit scale enters the softmax as scale * q.k; use_qk_l2norm=True == passing l2norm(q) and
    l2norm(k)."""
    q, k, v = qkv(seed=1)
    o, _ = attention(q, k, v, scale=0.3)
    assert_rel(o, naive_attention(q, k, v, 0.3), TOL_F64, "explicit scale")
    o_norm, _ = attention(q, k, v, use_qk_l2norm=True)
    o_pre, _ = attention(l2norm(q), l2norm(k), v)
    assert_rel(o_norm, o_pre, TOL_F64, "use_qk_l2norm")
    o_ref = naive_attention(l2norm(q), l2norm(k), v, 12**-0.5)
    assert_rel(o_norm, o_ref, TOL_F64, "use_qk_l2norm vs naive")


@pytest.mark.parametrize("past", [1, 7])
def test_past_kv_matches_naive(past):
    """With a KV cache of P tokens, query i attends to the P past tokens and new tokens j <= i."""
    q, k, v = qkv(T=9, seed=past)
    pk, pv = qkv(T=past, seed=100 + past)[1:]
    o, (k_all, v_all) = attention(q, k, v, initial_state=(pk, pv), output_final_state=True)
    assert torch.equal(k_all, torch.cat([pk, k], dim=1)) and torch.equal(v_all, torch.cat([pv, v], dim=1))
    assert_rel(o, naive_attention(q, k_all, v_all, 12**-0.5, past=past), TOL_F64, "o")


@pytest.mark.parametrize(
    "splits", [[10], [1], [3, 4, 11], list(range(1, 20))], ids=["one-split", "split-at-1", "uneven", "token-by-token"]
)
def test_split_and_chain_equals_one_call(splits):
    """Running the sequence in pieces, passing the returned (k, v) cache on, == one call (o and cache)."""
    q, k, v = qkv(T=20, seed=3)
    o_full, (k_full, v_full) = attention(q, k, v, output_final_state=True)
    bounds = [0] + splits + [20]
    outs, state = [], None
    for a, b in zip(bounds, bounds[1:]):
        o, state = attention(q[:, a:b], k[:, a:b], v[:, a:b], initial_state=state, output_final_state=True)
        outs.append(o)
    assert_rel(torch.cat(outs, dim=1), o_full, TOL_F64, "o")
    assert torch.equal(state[0], k_full) and torch.equal(state[1], v_full)


def test_float32_matches_float64_reference():
    """float32 inputs: float32 output within float32 tolerance of the float64 reference."""
    q, k, v = qkv(T=40, dtype=torch.float32, seed=4)
    pk, pv = qkv(T=5, dtype=torch.float32, seed=5)[1:]
    o, _ = attention(q, k, v, initial_state=(pk, pv))
    assert o.dtype == torch.float32
    ref = naive_attention(q, torch.cat([pk, k], 1), torch.cat([pv, v], 1), 12**-0.5, past=5)
    assert_rel(o, ref, TOL_F32, "o")
