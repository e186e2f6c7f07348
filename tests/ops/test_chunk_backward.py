"""The chunk forms' own backward (`k3.ops.chunk.ChunkDelta`): float64 gradients of every input within
1e-10 of autograd through the token-by-token recurrence, on the shapes that exercise each of its
paths, plus what it keeps for the backward and its practical precision in float32 / bfloat16."""

from __future__ import annotations

import pytest
import torch

from .helpers import BASIC_MIXERS, assert_rel, make_inputs, mixer_params
from .test_gradients import as_inputs, grads, leaves

DELTA_MIXERS = [m for m in BASIC_MIXERS if m.has_beta]  # KDA, Gated DeltaNet, DeltaNet
TOL = 1e-10

# (B, T, H, K, V, chunk_size): T a multiple of C and not, T < C, H = 1 with odd head dims, and chunks of
# several sub-chunks (C = 48, 64: two of 24 / 32 tokens; C = 96: three of 32) for the off-diagonal blocks
SHAPES = [
    pytest.param((2, 37, 2, 6, 5, 16), id="T37-C16"),
    pytest.param((1, 5, 2, 4, 4, 16), id="T5<C16"),
    pytest.param((1, 29, 1, 5, 3, 8), id="H1-K5-V3"),
    pytest.param((1, 130, 2, 6, 5, 64), id="T130-C64"),
    pytest.param((2, 100, 1, 3, 7, 48), id="T100-C48"),
    pytest.param((1, 200, 1, 4, 4, 96), id="T200-C96"),
]


def upstream(B, T, H, V, N, K, seed=11):
    torch.manual_seed(seed)
    return torch.randn(B, T, H, V, dtype=torch.float64), [torch.randn(N, H, K, V, dtype=torch.float64)]


def check(mixer, inputs, B, T, H, K, V, N=None, tol=TOL, **kw):
    do, ds = upstream(B, T, H, V, N or B, K)
    want = grads(mixer, "recurrent", inputs, do, ds, **{k: v for k, v in kw.items() if k != "chunk_size"})
    got = grads(mixer, "chunk", inputs, do, ds, **kw)
    assert got.keys() == want.keys()
    for name in want:
        assert want[name].abs().sum() > 0, f"d/d{name} of the recurrence is identically zero"
        assert_rel(got[name], want[name], tol, f"d/d{name}")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mixer", mixer_params(DELTA_MIXERS))
def test_gradients_equal_the_recurrence(mixer, shape):
    """Every input's gradient (q, k, v, g, beta, initial state), random upstream gradients on o and the
    final state: chunk form == recurrence within 1e-10 (float64)."""
    B, T, H, K, V, C = shape
    inputs = make_inputs(mixer, B=B, T=T, H=H, K=K, V=V, seed=T + C, initial_state=True)
    check(mixer, inputs, B, T, H, K, V, chunk_size=C)


@pytest.mark.parametrize("gate_kind", ["hard", "extreme", "huge", "minus-inf", "steps"])
@pytest.mark.parametrize("mixer", mixer_params([m for m in DELTA_MIXERS if m.gate]))
def test_gradients_with_strong_gates(mixer, gate_kind):
    """Gates from near 0 to per-step decays of e^-100 (a sub-chunk's cumulative decay far past any
    exponent range), g = -inf at some steps (the state cleared), and single steps of e^-1000 and e^-30
    inside one half or another of a sub-chunk: gradients finite and equal to the recurrence's, at
    C = 64 (two sub-chunks)."""
    B, T, H, K, V = 1, 150, 2, 4, 3
    inputs = make_inputs(
        mixer,
        B=B,
        T=T,
        H=H,
        K=K,
        V=V,
        seed=5,
        initial_state=True,
        gate_kind="hard" if gate_kind in ("minus-inf", "steps") else gate_kind,
    )
    if gate_kind == "minus-inf":
        inputs["g"][:, [3, 70, 71, 140]] = -torch.inf
    if gate_kind == "steps":  # inside the first or second half of a sub-chunk, some channels only
        inputs["g"][:, [2, 27, 75, 130], :, ...] = -1000.0
        inputs["g"][:, [9, 20, 100], :, ...] = -30.0
        if inputs["g"].dim() == 4:
            inputs["g"][:, [2, 27], :, 0] = -0.01
    check(mixer, inputs, B, T, H, K, V, chunk_size=64)


@pytest.mark.parametrize("gate_kind", ["huge", "steps"])
def test_kda_float32_gradients_with_strong_gates(gate_kind):
    """float32 KDA through per-step decays of e^-100, or single steps of e^-1000 and e^-30 inside the
    halves of sub-chunks: gradients within practical tolerance of the float64 recurrence's on the same
    (rounded) inputs."""
    mixer = DELTA_MIXERS[0]
    B, T, H, K, V = 1, 150, 2, 16, 16
    kind = "huge" if gate_kind == "huge" else "safe"
    inputs = make_inputs(mixer, B=B, T=T, H=H, K=K, V=V, seed=7, initial_state=True, gate_kind=kind)
    if gate_kind == "steps":
        inputs["g"][:, [2, 27, 75, 130], :, : K // 2] = -1000.0
        inputs["g"][:, [9, 20, 100]] = -30.0
    low = {n: x.float() for n, x in inputs.items()}
    exact = {n: x.double() for n, x in low.items()}
    torch.manual_seed(0)
    do = torch.randn(B, T, H, V, dtype=torch.float64)
    want = grads(mixer, "recurrent", exact, do, [torch.zeros(B, H, K, V, dtype=torch.float64)])
    got = grads(mixer, "chunk", low, do.float(), [torch.zeros(B, H, K, V)], chunk_size=64)
    for name in want:
        assert_rel(got[name].double(), want[name], 2e-4, f"d/d{name}")


@pytest.mark.parametrize("mixer", mixer_params(DELTA_MIXERS))
def test_gradients_packed_sequences(mixer):
    """cu_seqlens with per-sequence initial states and a chunk of two sub-chunks, with the q/k
    normalisation inside the op."""
    cu_seqlens = torch.tensor([0, 40, 41, 150])
    B, T, H, K, V, N = 1, 150, 2, 6, 5, 3
    inputs = make_inputs(mixer, B=B, T=T, H=H, K=K, V=V, seed=9, initial_state=True, N=N, normalize_keys=False)
    check(mixer, inputs, B, T, H, K, V, N=N, chunk_size=64, cu_seqlens=cu_seqlens, use_qk_l2norm=True)


@pytest.mark.parametrize("mixer", mixer_params(DELTA_MIXERS))
def test_gradcheck_over_sub_chunks(mixer):
    """gradcheck (finite differences) of the chunk form with two sub-chunks per chunk and a partial last
    chunk."""
    inputs = make_inputs(mixer, B=1, T=11, H=1, K=3, V=2, seed=4, initial_state=True)
    leaf = leaves(inputs)
    names = list(leaf)

    def f(*xs):
        o, s = mixer("chunk", as_inputs(dict(zip(names, xs))), output_final_state=True, chunk_size=8)
        return o, s

    assert torch.autograd.gradcheck(f, tuple(leaf[n] for n in names), eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("mixer", mixer_params(DELTA_MIXERS))
def test_the_backward_keeps_little_beside_the_inputs(mixer):
    """The graph is the op's own backward, and it keeps only the inputs, W and U, the state entering each
    chunk, two C x C (lower-triangular) matrices per chunk and head and the gate's decay factors (KDA's
    one of the keys' size and small ones; Gated DeltaNet's one C x C matrix), within 2.5x the inputs plus the
    matrices: autograd through the forward keeps every intermediate, 3-4 times that here."""
    B, T, H, K, V, C = 2, 256, 2, 16, 16, 64
    inputs = {n: x.float() for n, x in make_inputs(mixer, B=B, T=T, H=H, K=K, V=V, seed=1).items()}
    leaf = leaves(inputs)
    saved = []

    def pack(x):
        saved.append(x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        o, _ = mixer("chunk", as_inputs(leaf), chunk_size=C)
    assert any(type(fn).__name__ == "ChunkDeltaBackward" for fn in _graph(o.grad_fn))
    storages = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes() for x in saved}
    kept = sum(storages.values())
    inputs_bytes = sum(x.numel() * 4 for x in leaf.values())
    matrices = (3 if mixer.name == "gdn" else 2) * (T // C) * B * H * C * C * 4
    assert kept <= 2.5 * inputs_bytes + matrices, (kept, inputs_bytes, matrices)
    o.sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in leaf.values())


def _graph(fn, seen=None):
    seen = set() if seen is None else seen
    if fn is None or fn in seen:
        return seen
    seen.add(fn)
    for nxt, _ in fn.next_functions:
        _graph(nxt, seen)
    return seen


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-4), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mixer", mixer_params(DELTA_MIXERS))
def test_low_precision_gradients(mixer, dtype, tol):
    """float32 and bfloat16 inputs (the state and matmuls accumulate in float32): gradients within
    practical tolerance of the float64 recurrence's on the same (rounded) inputs."""
    B, T, H, K, V = 1, 150, 2, 16, 16
    inputs = make_inputs(mixer, B=B, T=T, H=H, K=K, V=V, seed=3, initial_state=True)
    low = {n: x.to(dtype) if n != "initial_state" else x.float() for n, x in inputs.items()}
    exact = {n: x.to(torch.float64) for n, x in low.items()}
    torch.manual_seed(0)
    do = torch.randn(B, T, H, V, dtype=torch.float64)
    want = grads(mixer, "recurrent", exact, do, [torch.zeros(B, H, K, V, dtype=torch.float64)])
    got = grads(mixer, "chunk", low, do.to(dtype), [torch.zeros(B, H, K, V)], chunk_size=64)
    for name in want:
        assert_rel(got[name].double(), want[name], tol, f"d/d{name}")


@pytest.mark.parametrize("mixer", mixer_params(DELTA_MIXERS))
def test_a_retained_graph_backward_twice(mixer):
    """A second backward through a retained graph (the kept tensors, gates included, read again) gives the
    same gradients."""
    inputs = make_inputs(mixer, B=2, T=100, H=2, K=8, V=6, seed=5, initial_state=True)
    leaf = leaves(inputs)
    o, s = mixer("chunk", as_inputs(leaf), output_final_state=True, chunk_size=32)
    loss = (o * torch.randn_like(o)).sum() + s.square().sum()
    first = torch.autograd.grad(loss, list(leaf.values()), retain_graph=True)
    second = torch.autograd.grad(loss, list(leaf.values()))
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mixer", mixer_params(DELTA_MIXERS))
def test_gradients_over_several_slabs(mixer, monkeypatch):
    """Slabs of two chunks each (the shapes above fit one slab), the state's gradient carried between
    them; for the gated mixers, gates of up to e^-400 a step in some chunks only (float64), so that the
    slabs keep very different factors."""
    import k3.ops.chunk as chunk

    B, T, H, K, V, C = 1, 150, 2, 4, 3, 16
    monkeypatch.setattr(chunk, "SLAB_ELEMENTS", 2 * B * H * C * max(K, V))
    inputs = make_inputs(mixer, B=B, T=T, H=H, K=K, V=V, seed=13, initial_state=True, gate_kind="hard")
    if "g" in inputs:
        inputs["g"][:, 40:60] = -400.0 * torch.rand_like(inputs["g"][:, 40:60])
    check(mixer, inputs, B, T, H, K, V, chunk_size=C)
