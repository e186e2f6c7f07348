"""Numerical safety of the chunkwise gated forms: strong decays, g = -inf (state cleared), long sequences.

The chunk forms work with cumulative log decays; these tests push them where a naive implementation
(ratios of cumulative products, unbounded exponent factors) would under- or overflow.
"""

from __future__ import annotations

import pytest
import torch

from .helpers import GDN, KDA, assert_rel, make_inputs, mixer_params, slice_time, tol_for

GATED = mixer_params([KDA, GDN])


def clear_at(inputs: dict, positions, zero_beta: bool = False) -> dict:
    """Copy of `inputs` with g = -inf (every channel) at `positions`, and beta = 0 there if asked."""
    out = dict(inputs)
    out["g"] = inputs["g"].clone()
    out["g"][:, positions] = -float("inf")
    if zero_beta:
        out["beta"] = inputs["beta"].clone()
        out["beta"][:, positions] = 0.0
    return out


@pytest.mark.parametrize(
    "mixer,dtype",
    [
        pytest.param(KDA, torch.float32, id="kda-float32"),
        pytest.param(GDN, torch.float64, id="gdn-float64"),
    ],
)
def test_long_sequence_extreme_gates(mixer, dtype):
    """T = 16384, per-step g = -20 * U(0, 1) and g = -inf at a few positions: the chunk output is finite
    and equals the recurrence (fp32 rel RMS 5e-4, fp64 rel 1e-9), and after the last -inf step it
    equals a run from a zero state (the state is fully cleared)."""
    T = 16384
    x = make_inputs(mixer, B=1, T=T, H=1, K=8, V=8, dtype=dtype, seed=16384, gate_kind="extreme", initial_state=True)
    last = 16001
    x = clear_at(x, [5, 1000, 4097, 9999, last])
    o_ref, s_ref = mixer("recurrent", x, output_final_state=True)
    o, s = mixer("chunk", x, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert_rel(o, o_ref, tol_for(dtype), "o vs recurrence")
    assert_rel(s, s_ref, tol_for(dtype), "final state vs recurrence")
    o_tail, s_tail = mixer("chunk", slice_time(x, last, T), output_final_state=True)
    assert_rel(o[:, last:], o_tail, tol_for(dtype), "o after the last -inf step vs zero state")
    assert_rel(s, s_tail, tol_for(dtype), "final state vs zero state")


@pytest.mark.parametrize(
    "mixer,dtype",
    [
        pytest.param(KDA, torch.float64, id="kda-float64"),
        pytest.param(GDN, torch.float32, id="gdn-float32"),
    ],
)
def test_long_sequence_extreme_gates_chunk_only(mixer, dtype):
    """The other (op, dtype) pairs at T = 16384: chunk output finite, equal across chunk sizes 64 and 16,
    and equal to the recurrence on a 2000-token window that starts at a -inf step (where both forms
    start from a cleared state)."""
    T, start, stop = 16384, 9999, 11999
    x = make_inputs(mixer, B=1, T=T, H=1, K=8, V=8, dtype=dtype, seed=77, gate_kind="extreme", initial_state=True)
    x = clear_at(x, [5, 1000, 4097, start])
    o64, s64 = mixer("chunk", x, output_final_state=True, chunk_size=64)
    o16, s16 = mixer("chunk", x, output_final_state=True, chunk_size=16)
    assert torch.isfinite(o64).all() and torch.isfinite(s64).all()
    assert_rel(o16, o64, tol_for(dtype), "o, chunk_size 16 vs 64")
    assert_rel(s16, s64, tol_for(dtype), "final state, chunk_size 16 vs 64")
    o_ref, _ = mixer("recurrent", slice_time(x, start, stop))
    assert_rel(o64[:, start:stop], o_ref, tol_for(dtype), "o on the window vs recurrence")


@pytest.mark.parametrize("gate_kind", ["extreme", "huge"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("mixer", GATED)
def test_strong_decays_match_recurrence(mixer, dtype, gate_kind):
    """Per-step decays down to e^-20 and e^-100 (16-token sums far beyond the float32 exponent range):
    chunk == recurrence at chunk sizes 16, 24 and 64, outputs finite."""
    x = make_inputs(mixer, B=2, T=300, H=2, K=16, V=12, dtype=dtype, seed=31, gate_kind=gate_kind, initial_state=True)
    o_ref, s_ref = mixer("recurrent", x, output_final_state=True)
    for C in (16, 24, 64):
        o, s = mixer("chunk", x, output_final_state=True, chunk_size=C)
        assert_rel(o, o_ref, tol_for(dtype), f"o, chunk_size={C}")
        assert_rel(s, s_ref, tol_for(dtype), f"final state, chunk_size={C}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_kda_mixed_channel_rates(dtype):
    """KDA with slow channels (g ~ -1e-3), fast channels (g down to -60), -inf on some channels only and
    huge finite gates (-1e4, below any exp floor) in one head: chunk == recurrence."""
    T, K = 200, 16
    x = make_inputs(KDA, B=1, T=T, H=2, K=K, V=8, dtype=dtype, seed=41, initial_state=True)
    torch.manual_seed(42)
    g = torch.empty(1, T, 2, K, dtype=torch.float64)
    g[..., : K // 2] = -1e-3 * torch.rand(1, T, 2, K // 2, dtype=torch.float64)
    g[..., K // 2 :] = -60.0 * torch.rand(1, T, 2, K // 2, dtype=torch.float64)
    g[:, 17, :, 3] = -float("inf")
    g[:, 90, :, K // 2 :] = -float("inf")
    g[:, 150, 0] = -1e4
    x["g"] = g.to(dtype)
    o_ref, s_ref = KDA("recurrent", x, output_final_state=True)
    for C in (16, 64):
        o, s = KDA("chunk", x, output_final_state=True, chunk_size=C)
        assert_rel(o, o_ref, tol_for(dtype), f"o, chunk_size={C}")
        assert_rel(s, s_ref, tol_for(dtype), f"final state, chunk_size={C}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("mixer", GATED)
def test_minus_inf_gate_clears_state(mixer, form, dtype):
    """g = -inf at step p with beta = 0 there clears the state: o_p = 0, the outputs after p equal those
    of a run from a zero state, and the final state too; with g = -inf at step 0 the initial state is
    ignored entirely."""
    T, p = 100, 37  # p not chunk-aligned
    kw = {"chunk_size": 16} if form == "chunk" else {}
    x = make_inputs(mixer, B=2, T=T, H=2, K=8, V=6, dtype=dtype, seed=51, gate_kind="hard", initial_state=True)
    cleared = clear_at(x, [p], zero_beta=True)
    o, s = mixer(form, cleared, output_final_state=True, **kw)
    assert torch.isfinite(o).all()
    assert torch.count_nonzero(o[:, p]) == 0, "output at the clearing step must be exactly 0"
    o_rest, s_rest = mixer(form, slice_time(cleared, p + 1, T), output_final_state=True, **kw)
    assert_rel(o[:, p + 1 :], o_rest, tol_for(dtype), "o after clearing vs zero state")
    assert_rel(s, s_rest, tol_for(dtype), "final state vs zero state")

    first = clear_at(x, [0])
    o_a, s_a = mixer(form, first, output_final_state=True, **kw)
    o_b, s_b = mixer(form, {n: t for n, t in first.items() if n != "initial_state"}, output_final_state=True, **kw)
    assert_rel(o_a, o_b, tol_for(dtype), "o: initial state cleared at step 0")
    assert_rel(s_a, s_b, tol_for(dtype), "final state: initial state cleared at step 0")


@pytest.mark.parametrize("mixer", GATED)
def test_gradients_finite_with_extreme_gates(mixer):
    """Backward through -inf and e^-100 gates: chunk gradients are finite and equal the recurrence's
    (float64, rel 1e-8)."""
    x = make_inputs(mixer, B=1, T=40, H=1, K=6, V=5, seed=61, gate_kind="huge", initial_state=True)
    x["g"] = x["g"] / 5.0  # mix of moderate and strong decays
    x["g"][:, 3] = -100.0
    x["g"][:, 20] = -float("inf")
    names = ["q", "k", "v", "beta", "initial_state"]
    torch.manual_seed(62)
    do, ds = torch.randn(1, 40, 1, 5, dtype=torch.float64), torch.randn(1, 1, 6, 5, dtype=torch.float64)

    def grads(form, **kw):
        leaf = {n: t.detach().clone().requires_grad_(n in names) for n, t in x.items()}
        o, s = mixer(form, leaf, output_final_state=True, **kw)
        return torch.autograd.grad((o * do).sum() + (s * ds).sum(), [leaf[n] for n in names])

    for name, a, b in zip(names, grads("chunk", chunk_size=16), grads("recurrent")):
        assert torch.isfinite(a).all(), f"d/d{name} not finite"
        assert_rel(a, b, 1e-8, f"d/d{name}")


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_kda_large_inputs_near_factor_limit(chunk_size):
    """Unnormalised q, k of size 1000 with g = -5 on every channel (a 16-token sub-chunk spans 75): decays
    factored around a sub-chunk's middle (as k3 once did) no longer cancel above the diagonal and
    overflow there, where inf * 0 = NaN. The chunk form's outputs must be finite and equal the
    recurrence's."""
    from k3.ops import chunk_kda, recurrent_kda

    B, T, H, K, V = 1, 64, 2, 64, 8
    q = torch.full((B, T, H, K), 1000.0)
    k = torch.full((B, T, H, K), 1000.0)
    v = torch.randn(B, T, H, V, generator=torch.Generator().manual_seed(0))
    g = torch.full((B, T, H, K), -5.0)
    beta = torch.full((B, T, H), 1e-8)  # beta * |k|^2 < 1 keeps the recurrence itself stable
    o_ref, _ = recurrent_kda(q, k, v, g, beta)
    o, _ = chunk_kda(q, k, v, g, beta, chunk_size=chunk_size)
    assert torch.isfinite(o_ref).all()
    assert torch.isfinite(o).all()
    assert_rel(o, o_ref, tol_for(torch.float32), "o vs recurrence")


@pytest.mark.parametrize("chunk_size", [32, 64])
def test_kda_float32_gradients_with_saturated_safe_gate(chunk_size):
    """K3's safe gate saturated at g = -5 on every channel: a 32-token sub-chunk decays by exp(-160), and
    factors around its middle (as k3 once used) reach exp(+-80); a backward through their reciprocal
    carried exp(160) and made training diverge to NaN. Float32 gradients must be finite and match the
    recurrence."""
    from k3.ops import chunk_kda, recurrent_kda

    torch.manual_seed(0)
    B, T, H, K = 1, 128, 2, 16
    q, k, v = (torch.randn(B, T, H, K, requires_grad=True) for _ in range(3))
    g = torch.full((B, T, H, K), -4.99, requires_grad=True)
    beta = torch.rand(B, T, H, requires_grad=True)
    leaves = [q, k, v, g, beta]

    def grads(op, **kw):
        o, _ = op(q, k, v, g, beta, use_qk_l2norm=True, **kw)
        return torch.autograd.grad(o.square().sum(), leaves)

    for name, a, b in zip("q k v g beta".split(), grads(chunk_kda, chunk_size=chunk_size), grads(recurrent_kda)):
        assert torch.isfinite(a).all(), f"d/d{name} not finite"
        assert_rel(a, b, 1e-3, f"d/d{name}")
