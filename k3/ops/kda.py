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

from .delta_family import chunk_delta, delta_recurrence, run_delta_op


def recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None, use_qk_l2norm=False):
    """KDA token by token: the reference form, and the decode step (T = 1).

    q, k [B,T,H,K]; v [B,T,H,V]; g [B,T,H,K] log decay <= 0; beta [B,T,H]; initial_state [N,H,K,V];
    cu_seqlens [N+1] (B = 1). Returns (o [B,T,H,V], final state [N,H,K,V] or None)."""
    return run_delta_op("recurrent_kda", delta_recurrence, q, k, v, g, "channel", beta, scale,
                        initial_state, output_final_state, cu_seqlens, use_qk_l2norm, None)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, use_qk_l2norm=False, chunk_size=64):
    """KDA chunkwise-parallel (UT transform inside chunks, state across them); equals `recurrent_kda`.

    Arguments and result as `recurrent_kda`, plus chunk_size C: any T works (the last chunk is padded
    with no-op steps). Cost ~ 2*T*K*V + 2*T*C*K per head."""
    return run_delta_op("chunk_kda", chunk_delta, q, k, v, g, "channel", beta, scale,
                        initial_state, output_final_state, cu_seqlens, use_qk_l2norm, chunk_size)
