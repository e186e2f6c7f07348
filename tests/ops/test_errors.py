"""Bad input is rejected up front with a ValueError naming the argument, the expected and the actual value.

Each case starts from valid inputs (B = 1, T = 6, H = 2, K = 4, V = 3, float32 on the CPU), breaks one
thing, and applies to every op that takes the broken argument.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from k3.ops import (
    attention,
    chunk_delta_rule,
    chunk_gated_delta_rule,
    chunk_kda,
    chunk_linear_attn,
    recurrent_delta_rule,
    recurrent_gated_delta_rule,
    recurrent_kda,
    recurrent_linear_attn,
)

B, T, H, K, V = 1, 6, 2, 4, 3

OPS = {  # name: (function, family, is_chunk_form)
    "recurrent_kda": (recurrent_kda, "kda", False),
    "chunk_kda": (chunk_kda, "kda", True),
    "recurrent_gated_delta_rule": (recurrent_gated_delta_rule, "gdn", False),
    "chunk_gated_delta_rule": (chunk_gated_delta_rule, "gdn", True),
    "recurrent_delta_rule": (recurrent_delta_rule, "delta", False),
    "chunk_delta_rule": (chunk_delta_rule, "delta", True),
    "recurrent_linear_attn": (recurrent_linear_attn, "linear", False),
    "chunk_linear_attn": (chunk_linear_attn, "linear", True),
    "attention": (attention, "attention", False),
}
DELTA_FAMILY = {"kda", "gdn", "delta"}


def valid_inputs(family: str, batch: int = B) -> dict:
    """A valid set of keyword arguments for an op of `family` (float32, CPU)."""
    torch.manual_seed(0)
    x = {"q": torch.randn(batch, T, H, K), "k": torch.randn(batch, T, H, K), "v": torch.randn(batch, T, H, V)}
    if family == "kda":
        x["g"] = -torch.rand(batch, T, H, K)
    if family == "gdn":
        x["g"] = -torch.rand(batch, T, H)
    if family in DELTA_FAMILY:
        x["beta"] = torch.rand(batch, T, H)
    return x


def shape(*dims) -> str:
    """Regex for a shape written as a list, tuple or torch.Size."""
    return r"[\[(]" + ", ".join(str(d) for d in dims) + r"[\])]"


def on_meta(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device="meta")


def state_for(family: str, n: int = B) -> dict:
    """A valid initial state for `family` and n sequences."""
    if family == "linear":
        return {"initial_state": (torch.zeros(n, H, K, V), torch.zeros(n, H, K))}
    if family == "attention":
        return {"initial_state": (torch.zeros(n, 3, H, K), torch.zeros(n, 3, H, V))}
    return {"initial_state": torch.zeros(n, H, K, V)}


@dataclass
class Case:
    """Break one argument: `mutate(valid_kwargs, family) -> kwargs`; the error must name `arg`, and its
    message must also match every regex in `contains` (the expected and/or the actual value)."""

    id: str
    arg: str
    mutate: Callable
    contains: tuple = ()
    families: set | None = None  # None: every op
    chunk_only: bool = False

    def applies_to(self, family: str, is_chunk: bool) -> bool:
        return (self.families is None or family in self.families) and (is_chunk or not self.chunk_only)


def replace(**changes):
    """mutate(): the valid kwargs with some entries replaced (callables get (kwargs, family))."""

    def mutate(x, family):
        return dict(x, **{n: (c(x, family) if callable(c) else c) for n, c in changes.items()})

    return mutate


GATED = {"kda", "gdn"}
STATEFUL_TUPLE = {"linear", "attention"}
TWO_SEQS = torch.tensor([0, 2, 6])
CASES = [
    # q, k, v: rank, shape, dtype, device
    Case("q-rank", "q", replace(q=lambda x, f: x["q"][0]), (shape(T, H, K),)),
    Case("k-head-dim", "k", replace(k=lambda x, f: x["k"][..., :3]), (shape(B, T, H, K), shape(B, T, H, 3))),
    Case("k-length", "k", replace(k=lambda x, f: x["k"][:, :5]), (shape(B, T, H, K), shape(B, 5, H, K))),
    Case("k-rank", "k", replace(k=lambda x, f: x["k"][0]), (shape(T, H, K),)),
    Case("v-heads", "v", replace(v=lambda x, f: x["v"][:, :, :1]), (shape(B, T, 1, V),)),
    Case("v-length", "v", replace(v=lambda x, f: x["v"][:, :4]), (shape(B, 4, H, V),)),
    Case("v-rank", "v", replace(v=lambda x, f: x["v"][0]), (shape(T, H, V),)),
    Case("k-dtype", "k", replace(k=lambda x, f: x["k"].double()), ("float64", "float32")),
    Case("v-dtype", "v", replace(v=lambda x, f: x["v"].half()), ("float16", "float32")),
    Case("k-device", "k", replace(k=lambda x, f: on_meta(x["k"])), ("meta", "cpu")),
    Case("v-device", "v", replace(v=lambda x, f: on_meta(x["v"])), ("meta", "cpu")),
    # cu_seqlens: B = 1, offsets 0 = c_0 < c_1 < ... < c_N = T
    Case("cu-seqlens-batch", "cu_seqlens", lambda x, f: dict(valid_inputs(f, batch=2), cu_seqlens=TWO_SEQS)),
    Case("cu-seqlens-repeated", "cu_seqlens", replace(cu_seqlens=torch.tensor([0, 3, 3, 6]))),
    Case("cu-seqlens-decreasing", "cu_seqlens", replace(cu_seqlens=torch.tensor([0, 4, 2, 6]))),
    Case("cu-seqlens-start", "cu_seqlens", replace(cu_seqlens=torch.tensor([1, 3, 6]))),
    Case("cu-seqlens-short", "cu_seqlens", replace(cu_seqlens=torch.tensor([0, 3, 5]))),
    Case("cu-seqlens-long", "cu_seqlens", replace(cu_seqlens=torch.tensor([0, 3, 7]))),
    # beta [B, T, H]
    Case("beta-shape", "beta", replace(beta=lambda x, f: x["beta"][..., 0]), (shape(B, T),), DELTA_FAMILY),
    Case("beta-dtype", "beta", replace(beta=lambda x, f: x["beta"].double()), ("float64", "float32"), DELTA_FAMILY),
    Case("beta-device", "beta", replace(beta=lambda x, f: on_meta(x["beta"])), ("meta", "cpu"), DELTA_FAMILY),
    # g: [B, T, H, K] (KDA) or [B, T, H] (Gated DeltaNet), every entry <= 0
    Case("g-shape", "g", replace(g=lambda x, f: x["g"][..., 0] if f == "kda" else x["g"][..., None]), families=GATED),
    Case("g-positive", "g", replace(g=lambda x, f: x["g"].index_fill(1, torch.tensor([2]), 0.5)), families=GATED),
    Case("g-dtype", "g", replace(g=lambda x, f: x["g"].double()), ("float64", "float32"), GATED),
    Case("g-device", "g", replace(g=lambda x, f: on_meta(x["g"])), ("meta", "cpu"), GATED),
    # initial_state of the delta family: [N, H, K, V]
    Case(
        "state-transposed",
        "initial_state",
        replace(initial_state=torch.zeros(B, H, V, K)),
        (shape(B, H, K, V), shape(B, H, V, K)),
        DELTA_FAMILY,
    ),
    Case("state-rank", "initial_state", replace(initial_state=torch.zeros(H, K, V)), (shape(H, K, V),), DELTA_FAMILY),
    Case(
        "state-batch",
        "initial_state",
        replace(initial_state=torch.zeros(2, H, K, V)),
        (shape(B, H, K, V), shape(2, H, K, V)),
        DELTA_FAMILY,
    ),
    Case(
        "state-cu-seqlens",
        "initial_state",
        replace(initial_state=torch.zeros(1, H, K, V), cu_seqlens=TWO_SEQS),
        (shape(2, H, K, V), shape(1, H, K, V)),
        DELTA_FAMILY,
    ),
    Case(
        "state-device",
        "initial_state",
        replace(initial_state=on_meta(torch.zeros(B, H, K, V))),
        ("meta", "cpu"),
        DELTA_FAMILY,
    ),
    # initial_state of linear attention: (S [N, H, K, V], z [N, H, K])
    Case("state-not-tuple", "initial_state", replace(initial_state=torch.zeros(B, H, K, V)), families=STATEFUL_TUPLE),
    Case(
        "state-S-shape",
        "initial_state",
        replace(initial_state=(torch.zeros(B, H, V, K), torch.zeros(B, H, K))),
        (shape(B, H, V, K),),
        {"linear"},
    ),
    Case(
        "state-z-shape",
        "initial_state",
        replace(initial_state=(torch.zeros(B, H, K, V), torch.zeros(B, H, V))),
        (shape(B, H, V),),
        {"linear"},
    ),
    # initial_state of attention: (past_k [B, P, H, K], past_v [B, P, H, V]), never with cu_seqlens
    Case(
        "state-past-heads",
        "initial_state",
        replace(initial_state=(torch.zeros(B, 3, 1, K), torch.zeros(B, 3, 1, V))),
        (shape(B, 3, 1, K),),
        {"attention"},
    ),
    Case(
        "state-past-lengths",
        "initial_state",
        replace(initial_state=(torch.zeros(B, 3, H, K), torch.zeros(B, 2, H, V))),
        (shape(B, 2, H, V),),
        {"attention"},
    ),
    Case(
        "state-past-dtype",
        "initial_state",
        replace(initial_state=(torch.zeros(B, 3, H, K).double(), torch.zeros(B, 3, H, V))),
        ("float64", "float32"),
        {"attention"},
    ),
    Case(
        "state-with-cu-seqlens",
        "initial_state",
        replace(initial_state=lambda x, f: state_for(f)["initial_state"], cu_seqlens=TWO_SEQS),
        families={"attention"},
    ),
    # chunk_size: a positive int
    Case("chunk-size-zero", "chunk_size", replace(chunk_size=0), ("0",), chunk_only=True),
    Case("chunk-size-negative", "chunk_size", replace(chunk_size=-16), ("-16",), chunk_only=True),
    Case("chunk-size-float", "chunk_size", replace(chunk_size=16.0), (r"16\.0",), chunk_only=True),
    Case("chunk-size-str", "chunk_size", replace(chunk_size="64"), ("64",), chunk_only=True),
]


def _params():
    return [
        pytest.param(op_name, case, id=f"{case.id}-{op_name}")
        for case in CASES
        for op_name, (_, family, is_chunk) in OPS.items()
        if case.applies_to(family, is_chunk)
    ]


@pytest.mark.parametrize("op_name,case", _params())
def test_bad_input_raises_value_error(op_name, case):
    """The op raises ValueError whose message names the broken argument (in backticks) and shows the
    expected and the actual value."""
    fn, family, _ = OPS[op_name]
    kwargs = case.mutate(valid_inputs(family), family)
    # the name in backticks, possibly with an index: `k`, `initial_state`, `initial_state[0] (S)`
    with pytest.raises(ValueError, match=rf"`{re.escape(case.arg)}(`|\[)") as info:
        fn(**kwargs)
    message = str(info.value)
    for pattern in case.contains:
        assert re.search(pattern, message), f"message {message!r} lacks {pattern!r}"


@pytest.mark.parametrize("op_name", list(OPS))
def test_valid_inputs_are_accepted(op_name):
    """Control: the unbroken inputs (with and without a valid initial state, and packed with cu_seqlens)
    run without error, so every failure above is due to the one broken argument."""
    fn, family, _ = OPS[op_name]
    o, _ = fn(**valid_inputs(family))
    assert o.shape == (B, T, H, V)
    fn(**valid_inputs(family), **state_for(family))
    fn(**valid_inputs(family), cu_seqlens=torch.tensor([0, 2, 6]))
    if family != "attention":
        fn(**valid_inputs(family), **state_for(family, n=2), cu_seqlens=torch.tensor([0, 2, 6]))


@pytest.mark.parametrize("op_name", [name for name, (_, family, _) in OPS.items() if family in GATED])
def test_gate_of_zero_and_minus_inf_are_accepted(op_name):
    """Control for the g check: g = 0 (no decay) and g = -inf (clear the state) are valid log decays."""
    fn, family, _ = OPS[op_name]
    x = valid_inputs(family)
    x["g"] = torch.zeros_like(x["g"])
    x["g"][:, 3] = -float("inf")
    o, _ = fn(**x)
    assert torch.isfinite(o).all()


def test_gates_may_stay_float32_beside_bfloat16_inputs():
    """g and beta in float32 beside bfloat16 q, k, v (how a layer computes its gates, and how fla's callers
    pass them): accepted, with the result of the same gates in bfloat16's dtype path; another dtype names both."""
    from k3.ops import chunk_kda

    q, k, v = (torch.randn(1, 6, 1, 4, dtype=torch.bfloat16) for _ in range(3))
    g, beta = -torch.rand(1, 6, 1, 4), torch.rand(1, 6, 1)
    o, _ = chunk_kda(q, k, v, g, beta)
    assert o.dtype == torch.bfloat16 and torch.isfinite(o).all()
    with pytest.raises(ValueError, match=r"`g` must be of dtype torch.bfloat16 \(the dtype of q\) or torch.float32"):
        chunk_kda(q, k, v, g.half(), beta)


@pytest.mark.parametrize("eps", [float("nan"), float("inf"), -1.0, "1e-6"])
@pytest.mark.parametrize("op_name", ["recurrent_linear_attn", "chunk_linear_attn"])
def test_eps_that_is_no_finite_number_at_least_zero_is_refused(op_name, eps):
    """Before: eps = NaN returned NaN everywhere and eps = -1 was accepted."""
    fn, family, _ = OPS[op_name]
    with pytest.raises(ValueError, match=rf"{op_name}: `eps` must be a (finite|Python) float"):
        fn(**valid_inputs(family), eps=eps)
    o, _ = fn(**valid_inputs(family), eps=0.0)
    assert torch.isfinite(o).all()


def test_l2norm_refuses_a_negative_or_non_finite_eps():
    from k3.ops import l2norm

    for eps in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="l2norm: `eps` must be a finite float >= 0"):
            l2norm(torch.randn(2, 4), eps=eps)
    assert torch.allclose(l2norm(torch.ones(1, 4), eps=0.0), torch.full((1, 4), 0.5))


@pytest.mark.parametrize("T_", [0, T])
@pytest.mark.parametrize("op_name", list(OPS))
def test_an_empty_batch_gives_an_empty_output(op_name, T_):
    """B = 0 (before: the chunk forms of the delta family failed in a reshape), with T = 0 and T > 0."""
    fn, family, _ = OPS[op_name]
    x = {name: t[:0, :T_] for name, t in valid_inputs(family).items()}
    o, _ = fn(**x)
    assert o.shape == (0, T_, H, V)
    if family in DELTA_FAMILY:
        _, S = fn(**x, initial_state=torch.zeros(0, H, K, V), output_final_state=True)
        assert S.shape == (0, H, K, V)


@pytest.mark.parametrize("choice", [5, ["torch"], b"torch"])
def test_kernel_choice_that_is_no_string_is_refused_naming_it(choice):
    """Before: use_kernels(5) was an AttributeError from str.strip."""
    from k3.ops import get_kernels, set_kernels, use_kernels

    before = get_kernels()
    with pytest.raises(ValueError, match=r"use_kernels: `choice` must be one of auto, torch, fla"):
        with use_kernels(choice):
            pass
    with pytest.raises(ValueError, match=r"set_kernels: `choice` must be one of auto, torch, fla"):
        set_kernels(choice)
    assert get_kernels() == before
