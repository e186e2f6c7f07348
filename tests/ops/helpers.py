"""Shared helpers for the `k3.ops` tests: a table of the mixers, input factories, error measures.

Every recurrent mixer is described by a `Mixer`: its token-by-token form, its chunkwise form, what kind
of gate it takes and whether it has a write strength beta. `make_inputs` builds deterministic keyword
arguments for any of them (always generated in float64 from `torch.manual_seed(seed)`, then cast, so
inputs of different dtypes built from one seed are the same numbers up to rounding).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from k3.ops import (
    chunk_delta_rule,
    chunk_gated_delta_rule,
    chunk_kda,
    chunk_linear_attn,
    recurrent_delta_rule,
    recurrent_gated_delta_rule,
    recurrent_kda,
    recurrent_linear_attn,
)

# Acceptance thresholds (rel = ||a - b|| / ||b||, which is also the relative RMS error).
TOL_F64 = 1e-9
TOL_F32 = 5e-4
TOL_BF16 = 2e-2
TOL_GRAD_F64 = 1e-8


@dataclass
class Mixer:
    """One recurrent sequence mixer: its two forms and the inputs it takes."""

    name: str
    recurrent: Callable
    chunk: Callable
    gate: str | None = None  # None, "head" (g [B,T,H]) or "channel" (g [B,T,H,K])
    has_beta: bool = True  # the delta family; False for linear attention
    gate_kind: str = "safe"  # how make_inputs draws g (see `make_gate`)
    extra: dict = field(default_factory=dict)  # fixed keyword arguments (normalize=...)

    @property
    def is_linear_attn(self) -> bool:
        return not self.has_beta

    def __call__(self, form: str, inputs: dict, **kwargs):
        fn = self.chunk if form == "chunk" else self.recurrent
        return fn(**inputs, **self.extra, **kwargs)


KDA = Mixer("kda", recurrent_kda, chunk_kda, gate="channel")
KDA_HARD = Mixer("kda-hardgate", recurrent_kda, chunk_kda, gate="channel", gate_kind="hard")
GDN = Mixer("gdn", recurrent_gated_delta_rule, chunk_gated_delta_rule, gate="head")
GDN_HARD = Mixer("gdn-hardgate", recurrent_gated_delta_rule, chunk_gated_delta_rule, gate="head", gate_kind="hard")
DELTA = Mixer("delta", recurrent_delta_rule, chunk_delta_rule)
LINEAR = Mixer("linear-norm", recurrent_linear_attn, chunk_linear_attn, has_beta=False, extra={"normalize": True})
LINEAR_PLAIN = Mixer(
    "linear-plain", recurrent_linear_attn, chunk_linear_attn, has_beta=False, extra={"normalize": False}
)

MIXERS = [KDA, KDA_HARD, GDN, GDN_HARD, DELTA, LINEAR, LINEAR_PLAIN]
BASIC_MIXERS = [KDA, GDN, DELTA, LINEAR, LINEAR_PLAIN]  # one gate kind each


def mixer_params(mixers=MIXERS):
    return [pytest.param(m, id=m.name) for m in mixers]


# ----------------------------------------------------------------------------------------------------
# input factories


def make_gate(kind: str, shape) -> torch.Tensor:
    """Log decays g <= 0 (float64).

    safe:    -5 * sigmoid(x), Kimi K3's bounded gate (alpha in (e^-5, 1));
    hard:    4 * logsigmoid(x), unbounded below, often close to 0;
    extreme: -20 * U(0, 1), per-step decays down to e^-20;
    huge:    -100 * U(0, 1), beyond what a float32 exponent of a 16-token sum can hold.
    """
    x = torch.randn(shape, dtype=torch.float64)
    if kind == "safe":
        return -5.0 * torch.sigmoid(x)
    if kind == "hard":
        return 4.0 * F.logsigmoid(x)
    if kind == "extreme":
        return -20.0 * torch.rand(shape, dtype=torch.float64)
    if kind == "huge":
        return -100.0 * torch.rand(shape, dtype=torch.float64)
    raise ValueError(kind)


def make_inputs(
    mixer: Mixer,
    B=1,
    T=16,
    H=2,
    K=8,
    V=8,
    dtype=torch.float64,
    *,
    seed=0,
    initial_state=False,
    N=None,
    gate_kind=None,
    normalize_keys=True,
) -> dict:
    """Keyword arguments (q, k, v[, g][, beta][, initial_state]) for `mixer`.

    Delta family: q ~ N(0, 1), k L2-normalised (unless `normalize_keys=False`), v ~ N(0, 1),
    beta = sigmoid(N(0, 1)), g from `make_gate`. Linear attention: positive features q, k ~ U(0, 1)
    (so the normalizer q . z stays away from 0). `initial_state` draws a state for N (default B)
    sequences: S ~ N(0, 1) [N, H, K, V] in the accumulation dtype, plus z ~ U(0, 5) [N, H, K] for
    linear attention.
    """
    torch.manual_seed(seed)
    f64 = torch.float64
    if mixer.is_linear_attn:
        q, k = torch.rand(B, T, H, K, dtype=f64), torch.rand(B, T, H, K, dtype=f64)
    else:
        q, k = torch.randn(B, T, H, K, dtype=f64), torch.randn(B, T, H, K, dtype=f64)
        if normalize_keys:
            k = F.normalize(k, dim=-1)  # exactly unit keys
    v = torch.randn(B, T, H, V, dtype=f64)
    inputs = {"q": q, "k": k, "v": v}
    if mixer.gate is not None:
        shape = (B, T, H, K) if mixer.gate == "channel" else (B, T, H)
        inputs["g"] = make_gate(gate_kind or mixer.gate_kind, shape)
    if mixer.has_beta:
        inputs["beta"] = torch.sigmoid(torch.randn(B, T, H, dtype=f64))
    inputs = {name: x.to(dtype) for name, x in inputs.items()}
    if initial_state:
        N = B if N is None else N
        state_dtype = f64 if dtype == f64 else torch.float32
        S0 = torch.randn(N, H, K, V, dtype=f64).to(state_dtype)
        if mixer.is_linear_attn:
            inputs["initial_state"] = (S0, (5.0 * torch.rand(N, H, K, dtype=f64)).to(state_dtype))
        else:
            inputs["initial_state"] = S0
    return inputs


SEQ_ARGS = ("q", "k", "v", "g", "beta")  # the arguments laid out along T (dim 1)


def slice_time(inputs: dict, start: int, stop: int) -> dict:
    """The same inputs restricted to time steps [start, stop) (initial_state dropped)."""
    return {name: x[:, start:stop] for name, x in inputs.items() if name in SEQ_ARGS}


def cast_inputs(inputs: dict, dtype) -> dict:
    """Cast the per-token inputs to `dtype` (states are left alone)."""
    return {name: (x.to(dtype) if name in SEQ_ARGS else x) for name, x in inputs.items()}


def state_index(state, n: int):
    """Sequence n's slice (kept 1 x ...) of a state [N, ...] or a tuple of such states."""
    if isinstance(state, (tuple, list)):
        return tuple(s[n : n + 1] for s in state)
    return state[n : n + 1]


# ----------------------------------------------------------------------------------------------------
# error measures


def _flat(x) -> torch.Tensor:
    if isinstance(x, (tuple, list)):
        return torch.cat([_flat(t) for t in x])
    return x.detach().to(torch.float64).flatten()


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| over all entries (tensors or tuples of tensors), in float64.

    Equal to the relative RMS error. Falls back to ||a - b|| when b is exactly zero."""
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        assert len(a) == len(b), f"state tuples differ in length: {len(a)} vs {len(b)}"
        for x, y in zip(a, b):
            assert x.shape == y.shape, f"shape mismatch {tuple(x.shape)} vs {tuple(y.shape)}"
    else:
        assert a.shape == b.shape, f"shape mismatch {tuple(a.shape)} vs {tuple(b.shape)}"
    fa, fb = _flat(a), _flat(b)
    diff, ref = (fa - fb).norm().item(), fb.norm().item()
    return diff / ref if ref > 0 else diff


rel_rms = rel_err


def assert_rel(a, b, tol: float, what: str = "") -> None:
    """Assert rel_err(a, b) <= tol, with the measured error in the message."""
    fa = _flat(a)
    assert torch.isfinite(fa).all(), f"{what}: non-finite values"
    err = rel_err(a, b)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e}"


def tol_for(dtype) -> float:
    return {torch.float64: TOL_F64, torch.float32: TOL_F32, torch.bfloat16: TOL_BF16}[dtype]
