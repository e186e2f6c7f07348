"""KDA's per-channel gate (`k3.ops.gates.ChannelGate`) against the decays taken pair by pair.

The gate factors exp(G_r - G_i) around sub-chunks and, inside each, by halves down to single positions;
every factor is <= 1 whatever the gates, so one path serves all of them. These tests compare its scores,
decayed rows and both applies (the backward's) with a dense [C, C, K] reference, for chunk sizes whose
sub-chunks are powers of two and not (padded), one sub-chunk and several, and gates whose cumulative
decay inside one sub-chunk is far past any dtype's exponent range: a huge step inside one half, g = -inf
(clamped to the floor), steps of e^-100. With a stated lower bound on the steps (Kimi K3's safe gate)
the halving stops early and the blocks left are factored whole around their middles: the same
comparisons, for bounds that leave blocks of every size. Without one, chunk_kda on the CPU takes the
gates' own smallest step as the bound (`halving_bound`): equal to the recurrence with and without it.
"""

from __future__ import annotations

import math

import pytest
import torch

from k3.ops import chunk as chunk_module
from k3.ops import chunk_kda, recurrent_kda
from k3.ops.gates import ChannelGate, halving_levels, sub_chunk_size
from k3.ops.numerics import DECAY_FLUSH, FACTOR_EXP_LIMIT, LOG_DECAY_FLOOR, halving_bound
from k3.ops.ut import BlockLower

TOL = {torch.float64: 1e-13, torch.float32: 1e-6}  # relative to the sum of the terms' magnitudes
# sub-chunks of 1, 2, 3, 7, 16, 24, 32 tokens (one per chunk), and 37 of 1, two of 20 or 24 (padded to 32),
# two and three of 32
CHUNKS = [1, 2, 3, 7, 16, 24, 32, 37, 40, 48, 64, 96]


def log_decays(kind: str, P: int, C: int, K: int, dtype) -> torch.Tensor:
    """Per-step g [P, C, K] (float64, then clamped at the dtype's floor as the chunk form does)."""
    g = -5.0 * torch.rand(P, C, K, dtype=torch.float64)
    if kind == "huge":
        g = -100.0 * torch.rand(P, C, K, dtype=torch.float64)
    elif kind == "g20":
        g = -20.0 * torch.rand(P, C, K, dtype=torch.float64)
    elif kind == "steps":  # a huge step early in a first half, one late in a second, -inf, e^-30 steps
        for pos, value in ((min(2, C - 1), -1e4), (min(13, C - 1), -float("inf")), (C // 2, -30.0), (C - 1, -60.0)):
            g[:, pos, : K - 1] = value
    return g.clamp(min=LOG_DECAY_FLOOR[dtype]).to(dtype)


def dense_decay(G: torch.Tensor, strict: bool) -> torch.Tensor:
    """exp(G_rc - G_ic) for i <= r (i < r if strict), else 0: [P, C(r), C(i), K], float64."""
    G = G.double()
    C = G.shape[1]
    D = torch.exp((G.unsqueeze(2) - G.unsqueeze(1)).clamp(max=0.0))
    return D * torch.ones(C, C, dtype=torch.float64).tril(-1 if strict else 0)[..., None]


def to_dense(M: BlockLower) -> torch.Tensor:
    P, m, s, _ = M.diag.shape
    out = M.diag.new_zeros(P, m * s, m * s)
    for a in range(m):
        out[:, a * s : (a + 1) * s, a * s : (a + 1) * s] = M.diag[:, a]
        if a:
            out[:, a * s : (a + 1) * s, : a * s] = M.below[a - 1]
    return out


def assert_sums(got, spec: str, a, b, D, mask, dtype, what: str, tol: float | None = None) -> None:
    """got equals the einsum `spec` of a, b and the decays D within rounding and flushing: per entry,
    `tol` (default TOL) times the sum of the terms' magnitudes, plus exp(DECAY_FLUSH) times their
    magnitudes undecayed (a decay below exp(DECAY_FLUSH) may come out flushed to 0 or kept; above it,
    it is kept)."""
    want = torch.einsum(spec, a, b, D)
    bound = (TOL[dtype] if tol is None else tol) * torch.einsum(spec, a.abs(), b.abs(), D)
    bound += math.exp(DECAY_FLUSH[dtype]) * torch.einsum(spec, a.abs(), b.abs(), mask)
    assert torch.isfinite(got).all(), f"{what}: not finite"
    excess = ((got.double() - want).abs() - bound).max().item()
    assert excess <= 0, f"{what}: off by more than rounding and flushing ({excess:.3e})"


# the steps' distribution, and the lower bound stated to the gate (None: halved down to single tokens)
KINDS = {
    "safe": ("safe", None),
    "huge": ("huge", None),
    "steps": ("steps", None),
    "safe-bounded": ("safe", -5.0),  # float32: blocks of 16 after one halving; float64: whole sub-chunks
    "g20-bounded": ("g20", -20.0),  # float32: blocks of 4; float64: whole sub-chunks
    "huge-bounded": ("huge", -100.0),  # float32: single tokens; float64: blocks of 4
}


def test_the_halving_stops_where_the_bound_allows():
    """Blocks of b tokens factored around their middle need (b/2)|bound| within the dtype's limit."""
    assert halving_levels(32, None, torch.float32) == halving_levels(32, None, torch.float64) == 5
    assert halving_levels(32, -5.0, torch.float32) == 1  # 16/2 * 5 = 40
    assert halving_levels(32, -5.0, torch.float64) == 0
    assert halving_levels(32, -20.0, torch.float32) == 3  # 4/2 * 20 = 40
    assert halving_levels(32, -100.0, torch.float32) == 5
    assert halving_levels(32, -100.0, torch.float64) == 3  # 4/2 * 100 = 200 <= 300 < 8/2 * 100
    assert halving_levels(1, -5.0, torch.float32) == 0


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("C", CHUNKS)
def test_channel_gate_equals_the_pairwise_decays(C, dtype, kind):
    """Scores, decayed rows and both applies equal the dense reference: rounding and flushed terms only.
    A block factored whole rounds each factor's exponent (up to FACTOR_EXP_LIMIT) to the dtype: up to
    about limit * eps relative per factor, three factors at most."""
    torch.manual_seed(C)
    P, K = 3, 5
    steps, lower_bound = KINDS[kind]
    tol = TOL[dtype] + (0.0 if lower_bound is None else 3 * FACTOR_EXP_LIMIT[dtype] * torch.finfo(dtype).eps)
    G = log_decays(steps, P, C, K, dtype).cumsum(1)
    q, k, Y, X1, X2 = (torch.randn(P, C, K, dtype=torch.float64).to(dtype) for _ in range(5))
    gate = ChannelGate(G, lower_bound)
    A_qk, A_kk, q_start, k_start, k_end, decay_end = gate.intra(q, k)
    incl, strict = dense_decay(G, False), dense_decay(G, True)
    masks = [(D > 0).double() for D in (incl, strict)]
    q, k, Y, X1, X2 = (x.double() for x in (q, k, Y, X1, X2))
    rows = "prc,pic,pric->pri"
    assert_sums(to_dense(A_qk), rows, q, k, incl, masks[0], dtype, "A_qk", tol)
    assert_sums(to_dense(A_kk), rows, k, k, strict, masks[1], dtype, "A_kk", tol)
    Gd = G.double()
    ones = torch.ones_like(Gd)
    for got, x, D, what in (
        (q_start, q, Gd, "q exp(G)"),
        (k_start, k, Gd, "k exp(G)"),
        (k_end, k, Gd[:, -1:] - Gd, "k exp(G_C - G)"),
        (decay_end.unsqueeze(1), ones[:, :1], Gd[:, -1:], "exp(G_C)"),
    ):
        assert_sums(
            got, "prc,prc,prc->prc", x, ones[:, : x.shape[1]], torch.exp(D), ones[:, : x.shape[1]], dtype, what, tol
        )

    # the backward's applies, for lower-triangular M (one with its diagonal, one strictly below it)
    s = sub_chunk_size(C)
    M1, M2 = (torch.randn(P, C, C, dtype=torch.float64).to(dtype) for _ in range(2))
    M1, M2 = M1.tril(), M2.tril(-1)
    Ms = [BlockLower.split(M, s) for M in (M1, M2)]
    M1, M2 = M1.double(), M2.double()
    for out, M in zip(gate.lower(Ms, Y.to(dtype)), (M1, M2)):
        assert_sums(out, "pri,pic,pric->prc", M, Y, incl, masks[0], dtype, "lower", tol)
    got = gate.upper_sum((Ms[0], X1.to(dtype)), (Ms[1], X2.to(dtype)))
    # one sum over both pairs: stack them along i's partner (r) so the bound covers both
    M, X = torch.cat([M1, M2], dim=1), torch.cat([X1, X2], dim=1)
    assert_sums(
        got,
        "pri,prc,pric->pic",
        M,
        X,
        torch.cat([incl, incl], dim=1),
        torch.cat([masks[0]] * 2, 1),
        dtype,
        "upper_sum",
        tol,
    )


def kda_inputs(B, T, H, K, V, dtype, bound=-5.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    g = (bound * torch.rand(B, T, H, K, generator=gen, dtype=torch.float64)).to(dtype)
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64).to(dtype)
    return r(B, T, H, K), r(B, T, H, K), r(B, T, H, V), g, beta, r(B, H, K, V)


@pytest.mark.parametrize(
    "B, T, H, K, V, C", [(2, 37, 2, 5, 3, 16), (1, 10, 1, 4, 4, 16), (2, 70, 3, 8, 6, 64), (1, 96, 1, 7, 5, 32)]
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_chunk_kda_with_a_lower_bound_equals_the_recurrence(B, T, H, K, V, C, dtype):
    """chunk_kda(lower_bound=-5) on gates in [-5, 0]: outputs, final state and every gradient equal the
    token loop's (float64 1e-10, float32 2e-5 relative)."""
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    inputs = kda_inputs(B, T, H, K, V, dtype)
    results = []
    for op, kwargs in ((recurrent_kda, {}), (chunk_kda, {"chunk_size": C, "lower_bound": -5.0})):
        xs = [x.clone().requires_grad_() for x in inputs]
        o, S = op(*xs[:5], initial_state=xs[5], output_final_state=True, use_qk_l2norm=True, **kwargs)
        (o.square().sum() + S.sum()).backward()
        results.append([o, S, *(x.grad for x in xs)])
    for want, got in zip(*results):
        assert (got - want).abs().max() <= tol * (1 + want.abs().max())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("read", [True, False], ids=["bound-read", "no-bound"])
@pytest.mark.parametrize("steps", [-0.5, -100.0])
def test_chunk_kda_without_a_stated_bound_equals_the_recurrence(steps, read, dtype, monkeypatch):
    """No bound stated: on the CPU the gates' own smallest step bounds the halving (gates in [-0.5, 0]:
    whole sub-chunks), elsewhere (`halving_bound` None: a GPU, a compiled graph) it halves down to single
    tokens. Either way outputs, final state and gradients equal the token loop's."""
    if not read:
        monkeypatch.setattr(chunk_module, "halving_bound", lambda g, lower_bound: lower_bound)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    inputs = kda_inputs(2, 70, 2, 6, 5, dtype, bound=steps, seed=3)
    results = []
    for op, kwargs in ((recurrent_kda, {}), (chunk_kda, {"chunk_size": 64})):
        xs = [x.clone().requires_grad_() for x in inputs]
        o, S = op(*xs[:5], initial_state=xs[5], output_final_state=True, use_qk_l2norm=True, **kwargs)
        (o.square().sum() + S.sum()).backward()
        results.append([o, S, *(x.grad for x in xs)])
    for want, got in zip(*results):
        assert (got - want).abs().max() <= tol * (1 + want.abs().max())


def test_the_bound_a_gate_states_itself():
    """`halving_bound`: a stated bound as given; per-channel gates in host memory their smallest step
    (0 at most); per-head gates, tensors on another device and a compiled graph read nothing (None)."""
    g = -0.5 * torch.rand(2, 9, 3, 4)
    assert halving_bound(g, -5.0) == -5.0
    assert halving_bound(g, None) == g.min().item()
    assert halving_bound(torch.zeros(2, 9, 3, 4), None) == 0.0
    assert halving_bound(g[..., :1], None) is None
    assert halving_bound(g.to("meta"), None) is None  # (a meta tensor has no value to read)
    compiled = torch.compile(lambda g: g * (halving_bound(g, None) is None), fullgraph=True, backend="eager")
    assert torch.equal(compiled(g), g)
    assert halving_levels(32, halving_bound(g, None), torch.float32) == 0


def test_chunk_kda_lower_bound_is_checked():
    """A bound that is not a negative float, or gates below it, are refused by name."""
    q, k, v, g, beta, _ = kda_inputs(1, 8, 1, 4, 4, torch.float32)
    for bad in (0.0, 1.0, float("nan"), "-5", True):
        with pytest.raises(ValueError, match="lower_bound"):
            chunk_kda(q, k, v, g, beta, lower_bound=bad)
    with pytest.raises(ValueError, match="lower_bound = -1.0"):
        chunk_kda(q, k, v, g, beta, lower_bound=-1.0)
    # unchecked, a gate below the bound is taken as the bound
    o, _ = chunk_kda(q, k, v, g, beta, lower_bound=-1.0, check_values=False)
    want, _ = chunk_kda(q, k, v, g.clamp(min=-1.0), beta)
    assert torch.allclose(o, want, atol=1e-6)
