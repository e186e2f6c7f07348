"""Causal softmax attention, the lineage's starting point (GPT-2).

    o_i = sum_{j <= P + i} softmax_j(scale * q_i . k_j) v_j

where P is the number of cached past tokens. The "state" is the KV cache itself, so it grows O(T):
the cost linear attention and its descendants remove.

Shapes: q, k [B, T, H, K]; v [B, T, H, V]; initial_state (past_k [N, P, H, K], past_v [N, P, H, V]);
with output_final_state the returned state is (k, v) including the new tokens. With `cu_seqlens`
(B = 1, packed sequences attend only within themselves) initial_state must be None, and the returned
state is the packed (k, v) as given, to be read with the same `cu_seqlens`.
Returns (o [B, T, H, V], state or None).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import (
    cast,
    check_cu_seqlens,
    check_qkv,
    check_scale,
    check_tensor,
    compute_dtype,
    keep_causal,
    l2norm,
    nonfinite_onwards,
    run_packed,
)


def causal_mask(T: int, S: int, start: torch.Tensor | None = None, device=None) -> torch.Tensor | None:
    """Which of S slots each of the last T positions may attend to: [T, S], or [B, 1, T, S] with `start`.

    Query i sits at slot S - T + i and sees slots <= S - T + i; with `start` [B] (rows of different
    lengths batched together: row b's first `start[b]` slots hold no token) only slots >= start[b].
    None when nothing is masked (one query, no start)."""
    if start is None and T == 1:
        return None
    allowed = torch.ones(T, S, dtype=torch.bool, device=device).tril(S - T)
    if start is None:
        return allowed
    filled = torch.arange(S, device=device) >= start.to(device)[:, None]  # [B, S]
    return (allowed & filled[:, None, :]).unsqueeze(1)


def causal_attention(
    q, k, v, scale: float, start: torch.Tensor | None = None, mask: torch.Tensor | None = None, guard: bool = False
):
    """The attention of the last T positions of a sequence over all of it (internal: no checks, the
    core of `attention` and of the decode steps of the attention layers).

    q [B, T, H, K] sits at slots S - T ... S - 1 of k [B, S, H, K] and v [B, S, H, V] (the cache
    followed by this call's tokens); query i attends to slots <= S - T + i, and, with `start` [B], to
    none before start[b] (see `causal_mask`). Computed in the accumulation dtype (float32, float64 for
    float64 inputs). Returns o [B, T, H, V] in q's dtype.

    Keys and values of different head sizes (MLA: K = dn + dr, V = dv) are zero-padded to one size:
    the fused kernel, which never holds the [T, S] scores of a head, takes only one; without it the
    scores of every head are materialised (quadratic memory in a long prefill). Zero columns change
    neither the scores (the scale is given) nor the kept output columns. With `guard` (the public
    `attention` op's), a NaN or inf among this call's keys or values reaches no earlier query
    (`k3.ops.common.keep_causal`), at the cost of reading them back from the device; the layers go without.

    `mask` [B, 1, T, S] (bool, True where a query may look), when given, replaces the causal mask and
    `start`: a cache's slots (`k3.inference.cache.Cache.visible`), where rows write this call's tokens
    at slots of their own (the guard above is then off)."""
    T, S = q.shape[1], k.shape[1]
    dtype = compute_dtype(q.dtype)
    qf, kf, vf = (cast(x, dtype) for x in (q, k, v))
    onwards = None if T == 1 or mask is not None or not guard else nonfinite_onwards(kf[:, S - T :], vf[:, S - T :])
    o = _fused_attention(qf, kf, vf, scale, start, mask)
    o = keep_causal(
        o,
        onwards,
        lambda zero: _fused_attention(
            qf,
            torch.cat([kf[:, : S - T], zero(kf[:, S - T :])], 1),
            torch.cat([vf[:, : S - T], zero(vf[:, S - T :])], 1),
            scale,
            start,
            mask,
        ),
    )
    return cast(o, q.dtype)


def _fused_attention(
    q, k, v, scale: float, start: torch.Tensor | None, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """`causal_attention` of inputs in the accumulation dtype, by torch's fused kernel (keys and values
    padded to one head size)."""
    T, S = q.shape[1], k.shape[1]
    K, V = q.shape[-1], v.shape[-1]
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, T or S, d]
    if V < K:
        vh = F.pad(vh, (0, K - V))
    elif K < V:
        qh, kh = F.pad(qh, (0, V - K)), F.pad(kh, (0, V - K))
    if mask is not None:
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    elif T == S and start is None:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_mask(T, S, start, q.device), scale=scale)
    return o[..., :V].transpose(1, 2)


def attention(
    q,
    k,
    v,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    use_qk_l2norm=False,
    check_values=True,
):
    """Causal softmax attention with an optional KV cache.

    q, k [B,T,H,K]; v [B,T,H,V]; initial_state (past_k [B,P,H,K], past_v [B,P,H,V]); cu_seqlens [N+1]
    (B = 1, no past). Returns (o [B,T,H,V], (k, v) with the new tokens appended, or None).
    `check_values` as the delta family's (`k3.ops.delta_family.run_delta_op`): False skips the guard that
    keeps a NaN or inf from reaching earlier queries, and its read-back (what the layers pass)."""
    op = "attention"
    B, T, H, K, V = check_qkv(op, q, k, v)
    cu_seqlens = check_cu_seqlens(op, cu_seqlens, B, T, q.device)
    scale = check_scale(op, scale, K)
    if initial_state is not None:
        if cu_seqlens is not None:
            raise ValueError(
                f"{op}: `initial_state` must be None when `cu_seqlens` is given, "
                f"got a past of type {type(initial_state).__name__}"
            )
        if not (isinstance(initial_state, (tuple, list)) and len(initial_state) == 2):
            raise ValueError(
                f"{op}: `initial_state` must be a tuple (past_k [B, P, H, K], past_v [B, P, H, V]),"
                f" got {type(initial_state).__name__}"
            )
        past_k, past_v = initial_state
        check_tensor(op, "initial_state[0] (past_k)", past_k, (B, None, H, K), q)
        check_tensor(op, "initial_state[1] (past_v)", past_v, (B, past_k.shape[1], H, V), q)
        k_all, v_all = torch.cat([past_k, k], dim=1), torch.cat([past_v, v], dim=1)
    else:
        k_all, v_all = k, v

    qf, kf, vf = q, k_all, v_all
    if use_qk_l2norm:
        dtype = compute_dtype(q.dtype)
        qf, kf = l2norm(cast(qf, dtype)), l2norm(cast(kf, dtype))

    def run(q_, k_, v_):
        return causal_attention(q_, k_, v_, scale, guard=check_values), None

    o, _ = run_packed(run, cu_seqlens, qf, kf, vf)
    return cast(o, q.dtype), ((k_all, v_all) if output_final_state else None)
