"""The delta family's front door: DeltaNet, Gated DeltaNet and KDA are one recurrence.

Per head, with row vectors q, k in R^K, v in R^V, a per-channel decay a_t = exp(g_t) in (0, 1]^K
(a scalar broadcast over channels for Gated DeltaNet, 1 for DeltaNet) and a write strength beta_t:

    S' = Diag(a_t) S_{t-1}
    S_t = S' + beta_t k_t^T (v_t - k_t S')            o_t = scale * q_t S_t

Each op's file holds its own token loop (the reference, and the decode step) beside its chunk form;
the chunk forms share one engine (`k3.ops.chunk`). `run_delta_op` is the one place that validates the
public arguments, casts to the accumulation dtype and packs `cu_seqlens` for either form;
`token_loop` is the frame every token loop runs in.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import fla_kernels  # noqa: F401  (registers the torch.ops.k3.fla_* custom ops)
from .common import (
    autocast_dtype,
    cast,
    check_chunk_size,
    check_cu_seqlens,
    check_log_decay,
    check_lower_bound,
    check_qkv,
    check_scale,
    check_state,
    check_tensor,
    compute_dtype,
    inference_unless_grad,
    keep_causal,
    l2norm,
    nonfinite_onwards,
    run_packed,
    without_autocast,
)
from .kernels import fla_runs
from .numerics import log_decay_floor


def token_loop(recurrence: Callable) -> Callable:
    """The form (same calling convention as `k3.ops.chunk.chunk_delta`, without chunk_size) that runs
    `recurrence(q, k, v, [g,] beta, S) -> (q_t S_t stacked [N,T,H,V], S_T [N,H,K,V])`, a per-op loop
    over the tokens (g is passed only when there is one), and applies the scale.

    The loop runs in inference mode when no gradient can flow; the scaling and the copy of the final
    state are made outside it, so that the caller gets ordinary tensors."""

    def form(q, k, v, beta, *, g=None, initial_state=None, scale: float):
        N, T, H, K = q.shape
        S = q.new_zeros(N, H, K, v.shape[-1]) if initial_state is None else initial_state
        if T == 0:
            return v.new_zeros(N, 0, H, v.shape[-1]), S
        gate = () if g is None else (g,)
        with inference_unless_grad(q, k, v, beta, g, initial_state):
            o, S = recurrence(q, k, v, *gate, beta, S)
        return o * scale, (S.clone() if S.is_inference() else S)

    return form


def run_delta_op(
    op: str,
    form: Callable,
    q,
    k,
    v,
    beta,
    *,
    g=None,
    gate: str | None = None,
    scale,
    initial_state,
    output_final_state: bool,
    cu_seqlens,
    use_qk_l2norm: bool,
    chunk_size: int | None = None,
    lower_bound: float | None = None,
    check_values: bool = True,
):
    """Validate the public arguments of `op`, cast to the accumulation dtype, pack/unpack `cu_seqlens`,
    and run `form` (a `token_loop`, or `chunk_delta` when chunk_size is given).

    q, k [B,T,H,K]; v [B,T,H,V]; beta [B,T,H]; `gate` None (g None), "head" (g [B,T,H]) or "channel"
    (g [B,T,H,K]); g and beta in q's dtype or float32; `lower_bound` (KDA's chunk form) None or a float < 0
    that every g is at least.
    Returns (o [B,T,H,V] in q's dtype, final state [N,H,K,V] or None).

    `check_values` (every public op's last argument, default True) looks at the values, which reads them
    back from the device: g must be a log decay (<= 0), and a chunk form keeps a NaN or inf from reaching
    earlier outputs (`k3.ops.common.keep_causal`). False skips both: what the layers pass, whose inputs are
    their own projections (g <= 0 by construction) and whose forward must not wait on the device; a
    non-finite value there reaches the loss, which the training step checks once per step."""
    B, T, H, K, V = check_qkv(op, q, k, v)
    # the gates may stay float32 beside bfloat16 q, k, v (a layer computes them in it)
    if gate == "head":
        check_tensor(op, "g", g, (B, T, H), q, also=torch.float32)
    elif gate == "channel":
        check_tensor(op, "g", g, (B, T, H, K), q, also=torch.float32)
    check_tensor(op, "beta", beta, (B, T, H), q, also=torch.float32)
    cu_seqlens = check_cu_seqlens(op, cu_seqlens, B, T, q.device)
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    S0 = check_state(op, "initial_state", initial_state, (N, H, K, V), q)
    scale = check_scale(op, scale, K)
    chunking = {}
    if chunk_size is not None:
        chunking["chunk_size"] = check_chunk_size(op, chunk_size)
        chunking["guard"] = check_values
    if lower_bound is not None:
        chunking["lower_bound"] = check_lower_bound(op, lower_bound)
    if g is not None and check_values:
        check_log_decay(op, g, lower_bound)
    if fla_runs(op, q, lambda: _fla_cannot(q, k, v, beta, g, chunk_size, gate)):
        o, S = _run_fla(
            q, k, v, beta, g, gate, S0, cu_seqlens, scale, use_qk_l2norm, chunk_size, lower_bound, check_values
        )
        return o, (S if output_final_state else None)

    in_dtype, dtype = q.dtype, compute_dtype(q.dtype)
    q, k, v, beta = (cast(x, dtype) for x in (q, k, v, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    g = None if g is None else cast(g, dtype)

    def run(q, k, v, beta, g):
        return form(q, k, v, beta, g=g, initial_state=S0, scale=scale, **chunking)

    with without_autocast(q):  # under bf16 autocast too, the state and its matmuls stay in `dtype`
        o, S = run_packed(run, cu_seqlens, q, k, v, beta, g)
    return cast(o, in_dtype), (S if output_final_state else None)


FLA_CHUNK_SIZES = {None: (16, 32, 64), "head": (16, 32, 64), "channel": (32, 64)}  # what fla 0.6 accepts
FLA_MAX_HEAD_DIM = 256
FLA_FLOAT32_DELTANET = False  # fla's public chunk_delta_rule refuses float32; the interpreter tests set True


def _fla_cannot(q, k, v, beta, g, chunk_size: int | None, gate: str | None) -> str | None:
    """Why fla's kernel cannot run this case exactly (None when it can); `k3.ops.kernels.fla_runs` logs it."""
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"dtype {q.dtype} (fla's kernels take float32, bfloat16 and float16)"
    if max(q.shape[-1], v.shape[-1]) > FLA_MAX_HEAD_DIM:
        return f"head dims K = {q.shape[-1]}, V = {v.shape[-1]} (fla's limit is {FLA_MAX_HEAD_DIM})"
    if q.shape[1] == 0 or q.shape[0] == 0:
        return f"an empty batch (B = {q.shape[0]}, T = {q.shape[1]})"
    if chunk_size is None:
        if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, beta, g)):
            return "a gradient through the recurrent form (k3 runs fla's fused recurrent kernel forward only)"
        return None
    if chunk_size not in FLA_CHUNK_SIZES[gate]:
        return f"chunk_size = {chunk_size} (fla's kernel takes {FLA_CHUNK_SIZES[gate]})"
    if gate is None and _fla_dtype(q) == torch.float32 and not FLA_FLOAT32_DELTANET:
        return "float32 DeltaNet (fla's chunk_delta_rule takes bfloat16 and float16 only)"
    return None


def _fla_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype fla's kernel gets q, k, v in: theirs, or autocast's for float32 ones (bfloat16 under
    `k3 train --precision bf16`, where a layer hands them over in float32), as autocast runs a matmul."""
    return (autocast_dtype(q) or q.dtype) if q.dtype == torch.float32 else q.dtype


def _run_fla(q, k, v, beta, g, gate, S0, cu_seqlens, scale, use_qk_l2norm, chunk_size, lower_bound, guard):
    """The op through fla's kernels (`k3.ops.fla_kernels`): q, k, v in `_fla_dtype`; beta as given; g
    clamped as k3's forms clamp it (`k3.ops.numerics.log_decay_floor`) in float32; the state in float32.
    Returns (o in q's dtype, final state)."""
    in_dtype, kernel_dtype = q.dtype, _fla_dtype(q)
    if use_qk_l2norm:  # in float32, as k3's own forms do, then back to the inputs' dtype
        q, k = (cast(l2norm(cast(x, torch.float32)), x.dtype) for x in (q, k))
    q, k, v = (cast(x, kernel_dtype) for x in (q, k, v))
    if g is not None:
        g = cast(g, torch.float32).clamp(min=log_decay_floor(torch.float32, lower_bound))
    S0 = None if S0 is None else cast(S0, torch.float32)
    kind = gate or "none"

    def run(k, v, beta, g):
        if chunk_size is None:
            return torch.ops.k3.fla_recurrent_delta(q, k, v, g, beta, S0, cu_seqlens, kind, scale)
        o, S, *_ = torch.ops.k3.fla_chunk_delta(q, k, v, g, beta, S0, cu_seqlens, kind, scale, chunk_size, lower_bound)
        return o, S

    o, S = run(k, v, beta, g)
    if guard and chunk_size is not None:  # no NaN or inf reaches an earlier output (k3.ops.common.keep_causal)
        onwards = nonfinite_onwards(k, v, beta)  # packed sequences are independent: [1, T, H] is fine
        o = keep_causal(o, onwards, lambda zero: run(zero(k), zero(v), zero(beta), zero(g))[0])
    return cast(o, in_dtype), S


def delta_step(q, k, v, beta, S, scale: float, decay=None):
    """One token of the recurrence, as a layer's decode step runs it (the ops' `*_step` functions):

        S' = decay * S;   u = beta (v - k S');   S_new = S' + k^T u;   o = scale * q S_new

    q, k [N, H, K] (already L2-normalised if the layer wants it); v [N, H, V]; beta [N, H];
    S [N, H, K, V]; decay None (DeltaNet) or a factor that broadcasts against S: [N, H, K, 1] per key
    channel (KDA), [N, H, 1, 1] per head (Gated DeltaNet). Returns (o [N, H, V], S_new [N, H, K, V]).

    Internal: no argument checks, casts, packing, loop frame or copies. The caller has validated its
    own input, passes every tensor in S's dtype (float32, or float64), and S is the state a prefill
    left, so the public `recurrent_*` op's work would be repeated for nothing on every token."""
    if decay is not None:
        S = S * decay
    k_col = k.unsqueeze(-1)  # [N, H, K, 1]
    u = beta.unsqueeze(-1) * (v - (k_col * S).sum(-2))  # beta (v - k S')  [N, H, V]
    S = torch.addcmul(S, k_col, u.unsqueeze(-2))
    return (q.unsqueeze(-1) * S).sum(-2) * scale, S
