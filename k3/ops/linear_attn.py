"""Linear attention: softmax removed, history folded into a fixed K x V state.

Per head, with feature-mapped q, k (the map, e.g. ELU+1, belongs to the layer) and q^ = scale * q:

    S_t = S_{t-1} + k_t^T v_t            z_t = z_{t-1} + k_t
    o_t = q^_t S_t / (q^_t . z_t + eps)  (normalize=True, the article's form)   or   o_t = q^_t S_t

The state never grows with T: that is the whole point, and the source of its interference once more
than ~K associations are stored.

Chunkwise form: inside a chunk, masked attention tril(Q K^T) V ("score first"); across chunks, the
state (S, z) carries everything earlier ("state first"); the states at chunk starts are one cumulative
sum, so no loop is needed. The normalizer rides along as an extra value column of ones.

Shapes: q, k [B, T, H, K]; v [B, T, H, V]; state (S [N, H, K, V], z [N, H, K]) in float32 (float64 for
float64 inputs), N = B or the number of packed sequences in `cu_seqlens`. Returns (o, (S, z) or None).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import (
    cast,
    check_chunk_size,
    check_cu_seqlens,
    check_eps,
    check_qkv,
    check_scale,
    check_state,
    compute_dtype,
    from_chunks,
    keep_causal,
    l2norm,
    nonfinite_onwards,
    run_packed,
    to_chunks,
    without_autocast,
)


def _recurrence(q, k, v1, S0):
    """S' = [S | z] with v1 = [v | 1]: o'_t = q_t S'_t. q, k [N,T,H,K]; v1 [N,T,H,V+1]."""
    N, T, H, K = q.shape
    S = q.new_zeros(N, H, K, v1.shape[-1]) if S0 is None else S0
    outputs = []
    for t in range(T):
        S = S + k[:, t].unsqueeze(-1) * v1[:, t].unsqueeze(-2)
        outputs.append((q[:, t].unsqueeze(-2) @ S).squeeze(-2))
    o = torch.stack(outputs, dim=1) if outputs else v1.new_zeros(N, 0, H, v1.shape[-1])
    return o, S


def _chunked(q, k, v1, S0, chunk_size, guard: bool = True):
    """Chunkwise: O = Q S_n + tril(Q K^T) V1 per chunk, with S_n = S_0 + sum of K_m^T V1_m over the
    earlier chunks m < n (one cumulative sum, no loop). Same arguments and result as `_recurrence`;
    a NaN or inf in k or v reaches no earlier output (`k3.ops.common.keep_causal`)."""
    onwards = nonfinite_onwards(k, v1) if guard else None
    o, S = _chunk_form(q, k, v1, S0, chunk_size)
    return keep_causal(o, onwards, lambda zero: _chunk_form(q, zero(k), zero(v1), S0, chunk_size)[0]), S


def _chunk_form(q, k, v1, S0, chunk_size):
    """`_chunked` for inputs whose rows are taken as they are."""
    N, T, H, K = q.shape
    V1 = v1.shape[-1]
    S0 = q.new_zeros(N, H, K, V1) if S0 is None else S0
    if T == 0:
        return v1.new_zeros(N, 0, H, V1), S0
    C = min(chunk_size, T)
    pad = (-T) % C
    if pad:
        q, k, v1 = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v1))
    qc, kc, vc = to_chunks(q, C), to_chunks(k, C), to_chunks(v1, C)  # [n, M, C, d]
    increments = kc.transpose(-1, -2) @ vc  # K_n^T V_n  [n, M, K, V1]
    states = torch.cat([S0.reshape(1, N * H, K, V1), increments]).cumsum(0)  # S at each chunk start
    o = qc @ states[:-1] + (qc @ kc.transpose(-1, -2)).tril_() @ vc
    return from_chunks(o, N, H)[:, :T], states[-1].view(N, H, K, V1)


def _linear_attn(
    op,
    form,
    q,
    k,
    v,
    scale,
    initial_state,
    output_final_state,
    cu_seqlens,
    use_qk_l2norm,
    normalize,
    eps,
    chunk_size=None,
    check_values=True,
):
    B, T, H, K, V = check_qkv(op, q, k, v)
    cu_seqlens = check_cu_seqlens(op, cu_seqlens, B, T, q.device)
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    S0 = None
    if initial_state is not None:
        if not (isinstance(initial_state, (tuple, list)) and len(initial_state) == 2):
            raise ValueError(
                f"{op}: `initial_state` must be a tuple (S [N, H, K, V], z [N, H, K]), "
                f"got {type(initial_state).__name__}"
            )
        S = check_state(op, "initial_state[0] (S)", initial_state[0], (N, H, K, V), q)
        z = check_state(op, "initial_state[1] (z)", initial_state[1], (N, H, K), q)
        S0 = torch.cat([S, z.unsqueeze(-1)], dim=-1)
    scale, eps = check_scale(op, scale, K), check_eps(op, eps)
    if chunk_size is not None:
        chunk_size = check_chunk_size(op, chunk_size)
    dtype = compute_dtype(q.dtype)
    qf, kf, vf = (cast(x, dtype) for x in (q, k, v))
    if use_qk_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    v1 = torch.cat([vf, torch.ones_like(vf[..., :1])], dim=-1)  # padding zeroes the ones column too

    def run(q_, k_, v_):
        return form(q_, k_, v_, S0) if chunk_size is None else form(q_, k_, v_, S0, chunk_size, check_values)

    with without_autocast(q):  # the state and its matmuls in the accumulation dtype under bf16 autocast too
        o1, S1 = run_packed(run, cu_seqlens, qf * scale, kf, v1)
    o = o1[..., :V] / (o1[..., V:] + eps) if normalize else o1[..., :V]
    state = (S1[..., :V], S1[..., V]) if output_final_state else None
    return cast(o, q.dtype), state


def linear_attn_step(q, k, v, state, scale: float, eps: float = 1e-6):
    """One normalised linear-attention token from state (S, z), for a layer's decode step (internal: no
    checks, casts or packing):

        S_new = S + k^T v;   z_new = z + k;   o = q^ S_new / (q^ . z_new + eps),   q^ = scale * q

    q, k [N,H,K] (feature-mapped); v [N,H,V]; state (S [N,H,K,V], z [N,H,K]), all in S's dtype.
    Returns (o [N,H,V], (S_new, z_new)), equal to `recurrent_linear_attn` with T = 1."""
    S, z = state
    S, z, q = torch.addcmul(S, k.unsqueeze(-1), v.unsqueeze(-2)), z + k, q * scale
    return (q.unsqueeze(-1) * S).sum(-2) / ((q * z).sum(-1, keepdim=True) + eps), (S, z)


def recurrent_linear_attn(
    q,
    k,
    v,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    use_qk_l2norm=False,
    normalize=True,
    eps=1e-6,
    check_values=True,
):
    """Linear attention token by token: the reference form, and the decode step (T = 1).

    q, k [B,T,H,K] (already feature-mapped); v [B,T,H,V]; initial_state (S [N,H,K,V], z [N,H,K]);
    cu_seqlens [N+1] (B = 1); normalize divides by q.z + eps. Returns (o [B,T,H,V], (S, z) or None)."""
    return _linear_attn(
        "recurrent_linear_attn",
        _recurrence,
        q,
        k,
        v,
        scale,
        initial_state,
        output_final_state,
        cu_seqlens,
        use_qk_l2norm,
        normalize,
        eps,
        check_values=check_values,
    )


def chunk_linear_attn(
    q,
    k,
    v,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    use_qk_l2norm=False,
    normalize=True,
    eps=1e-6,
    chunk_size=64,
    check_values=True,
):
    """Linear attention chunkwise-parallel; equals `recurrent_linear_attn` for any T.

    Arguments and result as `recurrent_linear_attn`, plus chunk_size C (any T)."""
    return _linear_attn(
        "chunk_linear_attn",
        _chunked,
        q,
        k,
        v,
        scale,
        initial_state,
        output_final_state,
        cu_seqlens,
        use_qk_l2norm,
        normalize,
        eps,
        chunk_size,
        check_values=check_values,
    )
