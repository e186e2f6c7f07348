"""Kimi Delta Attention (KDA): the delta rule with a per-channel forget gate.

Per head, with a per-channel log decay g_t in (-inf, 0]^K (alpha_t = exp(g_t)):

    S' = Diag(alpha_t) S_{t-1}
    S_t = S' + beta_t k_t^T (v_t - k_t S')
    o_t = scale * q_t S_t

Each key channel forgets at its own rate, so one head can keep slow and fast memories side by side
(Gated DeltaNet's single scalar alpha per head is the special case of equal channels).

Shapes: q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K]; beta [B, T, H];
initial_state / final state [N, H, K, V] (float32, float64 for float64 inputs), N = B or the number of
packed sequences in `cu_seqlens` ([N+1] offsets, B = 1). Returns (o [B, T, H, V], final_state or None).
"""

from __future__ import annotations

import torch

from .chunk import chunk_delta
from .delta_family import delta_step, run_delta_op, token_loop


def _recurrence(q, k, v, g, beta, S):
    """KDA token by token, per head (docs/design.md: the sequence mixers):

        S' = Diag(exp g_t) S_{t-1};  v_old = k_t S';  S_t = S' + beta_t k_t^T (v_t - v_old);  o_t = q_t S_t

    q, k [N,T,H,K]; v [N,T,H,V]; g [N,T,H,K]; beta [N,T,H]; S [N,H,K,V] the state before token 0.
    Each token is `delta_step`, the update a layer's decode step runs. Returns (o [N,T,H,V] before
    the scale, which `token_loop` applies; S_T [N,H,K,V])."""
    decay = torch.exp(g).unsqueeze(-1)  # exp g_t, one factor per key channel (row of S)  [N,T,H,K,1]
    outputs = []
    for t in range(q.shape[1]):
        o_t, S = delta_step(q[:, t], k[:, t], v[:, t], beta[:, t], S, 1.0, decay=decay[:, t])
        outputs.append(o_t)
    return torch.stack(outputs, dim=1), S


def kda_step(q, k, v, g, beta, S, scale: float):
    """One KDA token from state S, for a layer's decode step (internal: no checks, casts or packing;
    see `delta_step`). q, k [N,H,K] L2-normalised; v [N,H,V]; g [N,H,K]; beta [N,H]; S [N,H,K,V], all
    in S's dtype. Returns (o [N,H,V], new S [N,H,K,V]), equal to `recurrent_kda` with T = 1."""
    return delta_step(q, k, v, beta, S, scale, decay=torch.exp(g).unsqueeze(-1))


def recurrent_kda(
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
    """KDA token by token: the reference form, and the decode step (T = 1).

    q, k [B,T,H,K]; v [B,T,H,V]; g [B,T,H,K] log decay <= 0; beta [B,T,H]; initial_state [N,H,K,V];
    cu_seqlens [N+1] (B = 1). Returns (o [B,T,H,V], final state [N,H,K,V] or None)."""
    return run_delta_op(
        "recurrent_kda",
        token_loop(_recurrence),
        q,
        k,
        v,
        beta,
        g=g,
        gate="channel",
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm=use_qk_l2norm,
        check_values=check_values,
    )


def chunk_kda(
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
    lower_bound=None,
    check_values=True,
):
    """KDA chunkwise-parallel (UT transform inside chunks, state across them); equals `recurrent_kda`.

    Arguments and result as `recurrent_kda`, plus chunk_size C: any T works (the last chunk is padded
    with no-op steps), and lower_bound (fla's name): None, or a float < 0 that every g is at least
    (Kimi K3's safe gate: -5; check_values verifies it, else a g below it is taken as lower_bound).
    With it each sub-chunk's decays factor in fewer, larger blocks: the same result, faster
    (`k3.ops.gates.ChannelGate`). Cost ~ 2*T*K*V + 2*T*C*K per head."""
    return run_delta_op(
        "chunk_kda",
        chunk_delta,
        q,
        k,
        v,
        beta,
        g=g,
        gate="channel",
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm=use_qk_l2norm,
        chunk_size=chunk_size,
        lower_bound=lower_bound,
        check_values=check_values,
    )
