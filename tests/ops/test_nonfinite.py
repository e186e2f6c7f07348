"""Non-finite inputs keep causality: NaN or inf at position p of q, k, v or beta (and g = -inf, which is
legal and clears the state) never reaches an output before p. The chunk forms, whose masked matmuls
and triangular solves mix a chunk's rows, must give there what the recurrence gives; at and after p the
outputs are non-finite wherever the recurrence's are. Softmax attention against its own reference.
A NaN or +inf log decay g is refused (it is no log decay)."""

from __future__ import annotations

import math

import pytest
import torch

from k3.ops import attention

from .helpers import DELTA, GDN, KDA, LINEAR, LINEAR_PLAIN, assert_rel, make_inputs, mixer_params, tol_for

CHUNKED = mixer_params([KDA, GDN, DELTA, LINEAR, LINEAR_PLAIN])
T, P = 40, 21  # the bad position sits inside the second chunk of 16 (sub-chunks of 16, so 5 tokens in)


def spoil(inputs: dict, name: str, value: float, head: int = 0) -> dict:
    """Copy of `inputs` with `value` at position P of input `name`, in one head (every channel of it)."""
    out = dict(inputs)
    out[name] = inputs[name].clone()
    out[name][:, P, head] = value
    return out


def inputs_for(mixer, dtype, name: str) -> dict:
    x = make_inputs(mixer, B=2, T=T, H=2, K=8, V=8, dtype=dtype, seed=5, initial_state=True)
    if name not in x:
        pytest.skip(f"{mixer.name} takes no {name}")
    return x


@pytest.mark.parametrize(
    "value, dtype",
    [(math.nan, torch.float32), (math.inf, torch.float64), (-math.inf, torch.float32)],
    ids=["nan-float32", "inf-float64", "-inf-float32"],
)
@pytest.mark.parametrize("name", ["q", "k", "v", "beta"])
@pytest.mark.parametrize("mixer", CHUNKED)
def test_a_non_finite_input_reaches_no_earlier_output(mixer, name, value, dtype):
    x = spoil(inputs_for(mixer, dtype, name), name, value)
    o_ref, _ = mixer("recurrent", x, output_final_state=True)
    for chunk_size in (16, 64):  # the bad position inside a chunk (and its sub-chunk) and in the only chunk
        o, _ = mixer("chunk", x, output_final_state=True, chunk_size=chunk_size)
        assert_rel(o[:, :P], o_ref[:, :P], tol_for(dtype), f"{name}={value}: outputs before {P}")
        assert_same_where_finite(o, o_ref, tol_for(dtype))


def assert_same_where_finite(o, o_ref, tol: float) -> None:
    """o is non-finite exactly where o_ref is, and equal to it (within tol) everywhere else."""
    finite = torch.isfinite(o_ref)
    assert torch.equal(torch.isfinite(o), finite), "finite and non-finite outputs differ from the reference's"
    assert_rel(o[finite], o_ref[finite], tol, "the finite outputs")


@pytest.mark.parametrize("mixer", mixer_params([KDA, GDN]))
def test_a_cleared_state_is_exact_and_a_nan_log_decay_is_refused(mixer):
    x = inputs_for(mixer, torch.float64, "g")
    cleared = spoil(x, "g", -math.inf)
    o, s = mixer("chunk", cleared, output_final_state=True, chunk_size=16)
    o_ref, s_ref = mixer("recurrent", cleared, output_final_state=True)
    assert_rel(o, o_ref, tol_for(torch.float64), "g = -inf")
    assert_rel(s, s_ref, tol_for(torch.float64), "g = -inf: final state")
    for value in (math.nan, math.inf):
        with pytest.raises(ValueError, match="`g` must be a log decay"):
            mixer("chunk", spoil(x, "g", value), chunk_size=16)


def reference_attention(q, k, v, scale):
    """Causal softmax attention written out, position by position (float64)."""
    out = []
    for t in range(q.shape[1]):
        p = torch.softmax(torch.einsum("bhk,bshk->bhs", q[:, t], k[:, : t + 1]) * scale, dim=-1)
        out.append(torch.einsum("bhs,bshv->bhv", p, v[:, : t + 1]))
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("V", [8, 6], ids=["same-head-size", "mla-head-sizes"])
def test_attention_keeps_causality_for_non_finite_inputs(name, value, V):
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(2, T, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    x = {"q": q, "k": k, "v": torch.randn(2, T, 2, V, generator=g, dtype=torch.float64)}
    x = spoil(x, name, value)
    o, _ = attention(**x, scale=0.3)
    o_ref = reference_attention(x["q"], x["k"], x["v"], 0.3)
    assert_rel(o[:, :P], o_ref[:, :P], 1e-12, f"{name}={value}: outputs before {P}")
    assert_same_where_finite(o, o_ref, 1e-12)


@pytest.mark.parametrize(
    "scale, expected", [(math.nan, "a finite float"), (math.inf, "a finite float"), (True, "a Python float")]
)
def test_a_scale_that_is_no_finite_number_is_refused(scale, expected):
    from k3.ops import chunk_kda, recurrent_kda

    q, k, v = (torch.randn(1, 5, 1, 4, dtype=torch.float64) for _ in range(3))
    g, beta = -torch.rand(1, 5, 1, 4, dtype=torch.float64), torch.rand(1, 5, 1, dtype=torch.float64)
    for op in (chunk_kda, recurrent_kda):
        with pytest.raises(ValueError, match=f"`scale` must be {expected} or None"):
            op(q, k, v, g, beta, scale=scale)
