"""Gated DeltaNet: the delta rule with a scalar forget gate per head and token.

Per head, with log decay g_t <= 0 (alpha_t = exp(g_t)):

    S' = alpha_t S_{t-1}
    S_t = S' + beta_t k_t^T (v_t - k_t S')
    o_t = scale * q_t S_t

The gate lets the whole memory fade (alpha -> 0 clears it), which the plain delta rule cannot do.

Shapes: q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H]; beta [B, T, H];
initial_state / final state [N, H, K, V] (float32, float64 for float64 inputs), N = B or the number of
packed sequences in `cu_seqlens` ([N+1] offsets, B = 1). Returns (o [B, T, H, V], final_state or None).
"""

from __future__ import annotations

import torch

from .chunk import chunk_delta
from .delta_family import delta_step, run_delta_op, token_loop


def _recurrence(q, k, v, g, beta, S):
    """Gated DeltaNet token by token, per head (docs/design.md: the sequence mixers):

        S' = exp(g_t) S_{t-1};  v_old = k_t S';  S_t = S' + beta_t k_t^T (v_t - v_old);  o_t = q_t S_t

    q, k [N,T,H,K]; v [N,T,H,V]; g [N,T,H]; beta [N,T,H]; S [N,H,K,V] the state before token 0.
    Each token is `delta_step`, the update a layer's decode step runs. Returns (o [N,T,H,V] before
    the scale, which `token_loop` applies; S_T [N,H,K,V])."""
    decay = torch.exp(g.unsqueeze(-1)).unsqueeze(-1)  # exp g_t, one factor per head  [N,T,H,1,1]
    outputs = []
    for t in range(q.shape[1]):
        o_t, S = delta_step(q[:, t], k[:, t], v[:, t], beta[:, t], S, 1.0, decay=decay[:, t])
        outputs.append(o_t)
    return torch.stack(outputs, dim=1), S


def gated_delta_rule_step(q, k, v, g, beta, S, scale: float):
    """One Gated DeltaNet token from state S, for a layer's decode step (internal: no checks, casts or
    packing; see `delta_step`). q, k [N,H,K] L2-normalised; v [N,H,V]; g, beta [N,H]; S [N,H,K,V], all
    in S's dtype. Returns (o [N,H,V], new S [N,H,K,V]), equal to `recurrent_gated_delta_rule` with T = 1."""
    return delta_step(q, k, v, beta, S, scale, decay=torch.exp(g).view(*g.shape, 1, 1))


def recurrent_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    use_qk_l2norm=False,
    check_values=True,
):
    """Gated DeltaNet token by token: the reference form, and the decode step (T = 1).

    q, k [B,T,H,K]; v [B,T,H,V]; g [B,T,H] log decay <= 0; beta [B,T,H]; initial_state [N,H,K,V];
    cu_seqlens [N+1] (B = 1). Returns (o [B,T,H,V], final state [N,H,K,V] or None)."""
    return run_delta_op(
        "recurrent_gated_delta_rule",
        token_loop(_recurrence),
        q,
        k,
        v,
        beta,
        g=g,
        gate="head",
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm=use_qk_l2norm,
        check_values=check_values,
    )


def chunk_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    use_qk_l2norm=False,
    chunk_size=64,
    check_values=True,
):
    """Gated DeltaNet chunkwise-parallel; equals `recurrent_gated_delta_rule` for any T.

    Arguments and result as `recurrent_gated_delta_rule`, plus chunk_size C (any T)."""
    return run_delta_op(
        "chunk_gated_delta_rule",
        chunk_delta,
        q,
        k,
        v,
        beta,
        g=g,
        gate="head",
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm=use_qk_l2norm,
        chunk_size=chunk_size,
        check_values=check_values,
    )
