"""DeltaNet: linear attention that overwrites instead of piling up (the delta rule).

Per head, with write strength beta_t in (0, 1):

    v_old = k_t S_{t-1}                              (what the memory holds at address k_t)
    S_t = S_{t-1} + beta_t k_t^T (v_t - v_old)       (write only the difference)
    o_t = scale * q_t S_t

With beta = 1 and a unit key, reading k_t S_t returns v_t exactly: the old binding is replaced.

Shapes: q, k [B, T, H, K]; v [B, T, H, V]; beta [B, T, H];
initial_state / final state [N, H, K, V] (float32, float64 for float64 inputs), N = B or the number of
packed sequences in `cu_seqlens` ([N+1] offsets, B = 1). Returns (o [B, T, H, V], final_state or None).
"""

from __future__ import annotations

import torch

from .chunk import chunk_delta
from .delta_family import delta_step, run_delta_op, token_loop


def _recurrence(q, k, v, beta, S):
    """DeltaNet token by token, per head (docs/design.md: the sequence mixers):

        v_old = k_t S_{t-1};  S_t = S_{t-1} + beta_t k_t^T (v_t - v_old);  o_t = q_t S_t

    q, k [N,T,H,K]; v [N,T,H,V]; beta [N,T,H]; S [N,H,K,V] the state before token 0.
    Each token is `delta_step`, the update a layer's decode step runs. Returns (o [N,T,H,V] before
    the scale, which `token_loop` applies; S_T [N,H,K,V])."""
    outputs = []
    for t in range(q.shape[1]):
        o_t, S = delta_step(q[:, t], k[:, t], v[:, t], beta[:, t], S, 1.0)
        outputs.append(o_t)
    return torch.stack(outputs, dim=1), S


def delta_rule_step(q, k, v, beta, S, scale: float):
    """One DeltaNet token from state S, for a layer's decode step (internal: no checks, casts or packing;
    see `delta_step`). q, k [N,H,K] L2-normalised; v [N,H,V]; beta [N,H]; S [N,H,K,V], all in S's
    dtype. Returns (o [N,H,V], new S [N,H,K,V]), equal to `recurrent_delta_rule` with T = 1."""
    return delta_step(q, k, v, beta, S, scale)


def recurrent_delta_rule(
    q,
    k,
    v,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    use_qk_l2norm=False,
    check_values=True,
):
    """DeltaNet token by token: the reference form, and the decode step (T = 1).

    q, k [B,T,H,K]; v [B,T,H,V]; beta [B,T,H]; initial_state [N,H,K,V]; cu_seqlens [N+1] (B = 1).
    Returns (o [B,T,H,V], final state [N,H,K,V] or None)."""
    return run_delta_op(
        "recurrent_delta_rule",
        token_loop(_recurrence),
        q,
        k,
        v,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm=use_qk_l2norm,
        check_values=check_values,
    )


def chunk_delta_rule(
    q,
    k,
    v,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    use_qk_l2norm=False,
    chunk_size=64,
    check_values=True,
):
    """DeltaNet chunkwise-parallel (the article's `chunk_delta_rule_forward`); equals the recurrence.

    Arguments and result as `recurrent_delta_rule`, plus chunk_size C (any T)."""
    return run_delta_op(
        "chunk_delta_rule",
        chunk_delta,
        q,
        k,
        v,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm=use_qk_l2norm,
        chunk_size=chunk_size,
        check_values=check_values,
    )
