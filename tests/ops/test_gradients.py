"""Backward pass: the chunk forms' gradients equal the recurrences' (float64), and both match finite
differences."""

from __future__ import annotations

import pytest
import torch

from .helpers import (
    BASIC_MIXERS,
    TOL_GRAD_F64,
    assert_rel,
    make_inputs,
    mixer_params,
)

B, T, H, K, V = 1, 37, 2, 6, 5
CU_SEQLENS = torch.tensor([0, 10, 11, 37], dtype=torch.int64)


def leaves(inputs: dict) -> dict:
    """Detached copies of every tensor input (state tuples flattened to initial_state.0, .1), each
    requiring grad."""
    out = {}
    for name, x in inputs.items():
        if isinstance(x, tuple):
            for i, t in enumerate(x):
                out[f"{name}.{i}"] = t.detach().clone().requires_grad_(True)
        else:
            out[name] = x.detach().clone().requires_grad_(True)
    return out


def as_inputs(leaf: dict) -> dict:
    """Re-assemble op keyword arguments from `leaves`."""
    out = {name: x for name, x in leaf.items() if "." not in name}
    if "initial_state.0" in leaf:
        out["initial_state"] = (leaf["initial_state.0"], leaf["initial_state.1"])
    return out


def grads(mixer, form, inputs, do, ds, **kw):
    """Gradients of <o, do> + <final_state, ds> w.r.t. every input."""
    leaf = leaves(inputs)
    if form == "chunk":
        kw.setdefault("chunk_size", 16)
    o, s = mixer(form, as_inputs(leaf), output_final_state=True, **kw)
    loss = (o * do).sum()
    for part, d in zip(s if isinstance(s, tuple) else (s,), ds):
        loss = loss + (part * d).sum()
    names = list(leaf)
    gs = torch.autograd.grad(loss, [leaf[n] for n in names])
    return dict(zip(names, gs))


def upstream(mixer, N=B, seed=123):
    """Random upstream gradients for o and for (each part of) the final state."""
    torch.manual_seed(seed)
    do = torch.randn(B, T, H, V, dtype=torch.float64)
    ds = [torch.randn(N, H, K, V, dtype=torch.float64)]
    if mixer.is_linear_attn:
        ds.append(torch.randn(N, H, K, dtype=torch.float64))
    return do, ds


def assert_grads_match(g_chunk, g_ref):
    assert g_chunk.keys() == g_ref.keys()
    for name in g_ref:
        assert_rel(g_chunk[name], g_ref[name], TOL_GRAD_F64, f"d/d{name}")


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("mixer", mixer_params())
def test_chunk_gradients_match_recurrent(mixer, with_state):
    """Gradients w.r.t. q, k, v, g, beta and initial_state: chunk form (chunk_size 16, T = 37) ==
    recurrent form, rel 1e-8, with random upstream gradients on o and on the final state."""
    inputs = make_inputs(mixer, B=B, T=T, H=H, K=K, V=V, seed=7, initial_state=with_state)
    do, ds = upstream(mixer)
    g_ref = grads(mixer, "recurrent", inputs, do, ds)
    g_chunk = grads(mixer, "chunk", inputs, do, ds)
    expected = {"q", "k", "v"} | ({"g"} if mixer.gate else set()) | ({"beta"} if mixer.has_beta else set())
    if with_state:
        expected |= {"initial_state.0", "initial_state.1"} if mixer.is_linear_attn else {"initial_state"}
    assert set(g_ref) == expected
    for name, g in g_ref.items():
        assert g.abs().sum() > 0, f"d/d{name} of the recurrence is identically zero"
    assert_grads_match(g_chunk, g_ref)


@pytest.mark.parametrize("mixer", mixer_params(BASIC_MIXERS))
def test_chunk_gradients_match_recurrent_qk_l2norm_odd_chunk(mixer):
    """Same with use_qk_l2norm=True on raw q, k (gradients through the normalisation) and chunk_size 24."""
    inputs = make_inputs(mixer, B=B, T=T, H=H, K=K, V=V, seed=17, initial_state=True, normalize_keys=False)
    do, ds = upstream(mixer, seed=5)
    g_ref = grads(mixer, "recurrent", inputs, do, ds, use_qk_l2norm=True)
    g_chunk = grads(mixer, "chunk", inputs, do, ds, use_qk_l2norm=True, chunk_size=24)
    assert_grads_match(g_chunk, g_ref)


@pytest.mark.parametrize("mixer", mixer_params(BASIC_MIXERS))
def test_chunk_gradients_match_recurrent_cu_seqlens(mixer):
    """Same on packed sequences (cu_seqlens, per-sequence initial states)."""
    N = len(CU_SEQLENS) - 1
    inputs = make_inputs(mixer, B=1, T=T, H=H, K=K, V=V, seed=27, initial_state=True, N=N)
    do, ds = upstream(mixer, N=N, seed=6)
    g_ref = grads(mixer, "recurrent", inputs, do, ds, cu_seqlens=CU_SEQLENS)
    g_chunk = grads(mixer, "chunk", inputs, do, ds, cu_seqlens=CU_SEQLENS)
    assert_grads_match(g_chunk, g_ref)


@pytest.mark.parametrize("mixer", mixer_params())
def test_chunk_form_gradcheck(mixer):
    """torch.autograd.gradcheck of the chunk form (tiny shapes, several chunks): its analytic gradients
    match finite differences, so the shared gradients above are the true ones."""
    inputs = make_inputs(mixer, B=1, T=7, H=1, K=3, V=2, seed=2, initial_state=True)
    leaf = leaves(inputs)
    names = list(leaf)

    def f(*xs):
        args = as_inputs(dict(zip(names, xs)))
        o, s = mixer("chunk", args, output_final_state=True, chunk_size=3)
        return (o,) + (s if isinstance(s, tuple) else (s,))

    assert torch.autograd.gradcheck(f, tuple(leaf[n] for n in names), eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("mixer", mixer_params([m for m in BASIC_MIXERS if m.has_beta]))
def test_calls_without_gradients_hand_back_ordinary_tensors(mixer):
    """Without gradients the delta family runs in inference mode. What it returns must still be ordinary
    tensors (usable in place, and saved by autograd later), and a gradient run right after one (its
    cached masks first made in inference mode, at a chunk size no other test uses) still trains."""
    inputs = make_inputs(mixer, B=B, T=T, H=H, K=K, V=V, seed=3, initial_state=True)
    for form in ("recurrent", "chunk"):
        kw = {"chunk_size": 13} if form == "chunk" else {}
        with torch.no_grad():
            o, s = mixer(form, inputs, output_final_state=True, **kw)
        for x in (o, *(s if isinstance(s, tuple) else (s,))):
            assert not x.is_inference()
            x.mul_(1.0)  # in place, outside inference mode: refused for inference tensors
        leaf = leaves(inputs)
        o_grad, _ = mixer(form, as_inputs(leaf), output_final_state=True, **kw)
        (o_grad * o).sum().backward()
        assert all(x.grad is not None and x.grad.abs().sum() > 0 for x in leaf.values())


def test_l2norm_backward_equals_autograd_through_the_formula():
    """l2norm's hand-derived backward equals autograd through x * rsqrt(sum(x^2) + eps) in float64 (a zero
    row included), and gradcheck passes."""
    from k3.ops import l2norm

    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64) * 2
    x[0, 0, 0] = 0.0
    x.requires_grad_()
    seed = torch.randn_like(x)
    (got,) = torch.autograd.grad((l2norm(x) * seed).sum(), x)
    (want,) = torch.autograd.grad((x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6) * seed).sum(), x)
    assert ((got - want).norm() / want.norm()).item() <= 1e-12
    assert torch.autograd.gradcheck(l2norm, (x[:1, :2].detach().requires_grad_(),))
