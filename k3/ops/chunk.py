"""The chunkwise-parallel delta rule: one engine for DeltaNet, Gated DeltaNet and KDA.

This is the article's `chunk_delta_rule_forward`, generalised to gates. Per head, with cumulative log
decays G_i = g_1 + ... + g_i from the start of a chunk of C tokens and Gamma_i = exp(G_i), the state
at position r of the chunk is

    S_r = Diag(Gamma_r) S_0 + sum_{i<=r} Diag(exp(G_r - G_i)) k_i^T u_i,

where the corrections u solve the unit-lower-triangular system (the UT / WY transform, `k3.ops.ut`)

    (I + A) U = Diag(beta) (V - (K * Gamma) S_0),   A_ri = beta_r sum_c k_rc k_ic exp(G_rc - G_ic), i < r,

so U = U0 - W S_0 with W = (I + A)^-1 Diag(beta) (K * Gamma) and U0 = (I + A)^-1 Diag(beta) V. Then

    O   = (Q * Gamma) S_0 + tril(Aqk) U,         Aqk_ri = sum_c q_rc k_ic exp(G_rc - G_ic)
    S_C = Diag(Gamma_C) S_0 + (K * exp(G_C - G))^T U.

Everything but the last two lines is independent of S_0, so it runs for all chunks and heads of a
slab at once (`_intra_*_gate`, the UT transform); only the chunk-to-chunk state update is a loop
(`_state_scan`).

Numerics. No ratio of cumulative decay products (the article's gamma_r / gamma_i) is ever formed over
a chunk: exponents are differences G_r - G_i, taken where they are <= 0. The exception is KDA's
per-channel scores inside one sub-chunk of up to 32 tokens, factored as x_r exp(G_r - G_mid) times
k_i exp(G_mid - G_i) around the gate at its middle; a check bounds those exponents (FACTOR_EXP_LIMIT),
and any sub-chunk past the bound is computed pairwise, exactly. Negligible decay factors and UT
entries are flushed to zero (see `k3.ops.numerics`).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F

from .common import inference_unless_grad, keep_causal, nonfinite_onwards
from .numerics import DECAY_FLUSH, FACTOR_EXP_LIMIT, LOG_DECAY_FLOOR, decay_exp
from .ut import BlockLower

MAX_SUB_CHUNK = 32  # most tokens per sub-chunk: the diagonal blocks of the score matrices and of the UT transform
SLAB_ELEMENTS = 1 << 18  # values per tensor in one slab of chunks


def sub_chunk_size(C: int) -> int:
    """The size s of the sub-chunks a chunk of C tokens is split into: the largest divisor of C up to
    MAX_SUB_CHUNK."""
    return max(s for s in range(1, min(MAX_SUB_CHUNK, C) + 1) if C % s == 0)


@lru_cache(maxsize=64)
def _lower_masks(C: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """0/1 lower-triangular masks [C, C]: inclusive (q rows: i <= r) and strict (k rows: i < r).
    Ordinary tensors even when first asked for in inference mode, so that autograd can save them."""
    with torch.inference_mode(False):
        incl = torch.ones(C, C, dtype=dtype, device=device).tril()
        return incl, incl.tril(-1)


def _intra_scalar_gate(q, k, G):
    """Everything inside a chunk that does not depend on the incoming state, for a scalar gate per
    head (G [P, C, 1] cumulative log decay) or none (G None). q, k [P, C, K].

    Returns A_qk (incl. diagonal) and A_kk (strict) as `BlockLower` [P, C, C], q * Gamma, k * Gamma,
    k * exp(G_C - G) [P, C, K] and exp(G_C) [P, 1] (None without a gate)."""
    C = q.shape[-2]
    incl, strict = _lower_masks(C, q.dtype, q.device)
    k_t = k.transpose(-1, -2)
    s = sub_chunk_size(C)
    blocks = lambda A: BlockLower.split(A, s)  # noqa: E731
    if G is None:
        return blocks((q @ k_t) * incl), blocks((k @ k_t) * strict), q, k, k, None
    decay = decay_exp((G - G.transpose(-1, -2)).clamp(max=0.0))  # exp(G_r - G_i) for i <= r
    gamma = decay_exp(G)  # Gamma_r = exp(G_r) <= 1
    G_last = G[:, -1:]
    return (blocks((q @ k_t) * (decay * incl)), blocks((k @ k_t) * (decay * strict)), q * gamma, k * gamma,
            k * decay_exp(G_last - G), decay_exp(G_last.squeeze(-2)))


def _intra_channel_gate(q, k, G):
    """As `_intra_scalar_gate`, for a per-channel gate: G [P, C, K]; exp(G_C) comes back [P, K].
    The score matrices come as blocks of the sub-chunks below, never assembled.

    Score r,i = sum_c x_rc k_ic exp(G_rc - G_ic) (x = q or k). With sub-chunks a, b of up to
    32 tokens:
    - diagonal block (a, a): factor around G_mid(a), the cumulative gate at the middle of a:
      x_r exp(G_r - G_mid) times k_i exp(G_mid - G_i), each factor within exp(+-limit) while the gates
      of a stay within the limit on either side of its middle (for i <= r the product is
      exp(G_r - G_i) <= 1; above the diagonal it may overflow and is masked out). A sub-chunk past
      the limit gets its block computed pairwise, exactly.
    - off-diagonal block (a > b): exp(G_r - G_ref(a)) * exp(G_ref(a) - G_end(b)) * exp(G_end(b) - G_i),
      with G_ref(a) the gate just before a: three factors each <= 1, so nothing can overflow and an
      underflow only drops a negligible term.
    """
    P, C, K = q.shape
    s = sub_chunk_size(C)
    m = C // s
    limit, flush = FACTOR_EXP_LIMIT[q.dtype], DECAY_FLUSH[q.dtype]
    G_sub = G.view(P, m, s, K)
    q_sub, k_sub = q.view(P, m, s, K), k.view(P, m, s, K)

    G_end = G_sub[:, :, -1]  # [P, m, K] cumulative gate at the end of each sub-chunk
    G_ref = F.pad(G_end[:, :-1], (0, 0, 1, 0))  # ... just before each sub-chunk
    G_mid = G_sub[:, :, (s - 1) // 2]  # ... and at its middle
    rel = G_sub - G_mid.unsqueeze(2)  # >= 0 before the middle, <= 0 after it
    # safe: every factor around the middle, from the gate before the sub-chunk to its end, is a normal
    # number within exp(+-limit)
    unsafe = torch.maximum(G_ref - G_mid, G_mid - G_end).amax(-1) > limit  # [P, m]
    any_unsafe = bool(unsafe.any())
    rel = rel.clamp(-limit, limit) if any_unsafe else rel
    row = torch.exp(rel)  # exp(G_r - G_mid), clamped if unsafe
    # exp(G_mid - G_i), not 1 / row: the reciprocal's backward multiplies by col^2, up to exp(2 limit),
    # which overflows float32 in training where the forward never does
    col = torch.exp(-rel)
    # Entries above the diagonal may be inf: tril_ replaces them with 0 (a 0/1 mask would make NaN).
    diag_cols = (k_sub * col).transpose(-1, -2)  # [P, m, K, s]
    diag_qk = ((q_sub * row) @ diag_cols).tril_()  # [P, m, s, s]
    diag_kk = ((k_sub * row) @ diag_cols).tril_(-1)
    if any_unsafe:
        idx = unsafe.nonzero(as_tuple=True)
        G_b, k_b = G_sub[idx], k_sub[idx]  # [nb, s, K]
        pair = decay_exp((G_b.unsqueeze(2) - G_b.unsqueeze(1)).clamp(max=0.0))  # [nb, s(r), s(i), K]
        exact_qk = torch.einsum("brc,bic,bric->bri", q_sub[idx], k_b, pair).tril_()
        exact_kk = torch.einsum("brc,bic,bric->bri", k_b, k_b, pair).tril_(-1)
        diag_qk, diag_kk = diag_qk.index_put(idx, exact_qk), diag_kk.index_put(idx, exact_kk)

    # Decays to the sub-chunk's end and from the gate before it (for the first sub-chunk, the chunk
    # start): products of the factors above while they are exact, direct exponentials otherwise.
    threshold = math.exp(flush)
    if any_unsafe:
        to_end = decay_exp(G_end.unsqueeze(2) - G_sub)  # exp(G_end(b) - G_i)
        from_ref = decay_exp(G_sub - G_ref.unsqueeze(2))  # exp(G_r - G_ref(a))
    else:
        to_end = F.threshold(col * torch.exp(G_end - G_mid).unsqueeze(2), threshold, 0.0, inplace=True)
        from_ref = F.threshold(row * torch.exp(G_mid - G_ref).unsqueeze(2), threshold, 0.0, inplace=True)
    base = k_sub * to_end  # k_i exp(G_end(b) - G_i) <= 1
    q_off, k_off = q_sub * from_ref, k_sub * from_ref  # x_r exp(G_r - G_ref(a))
    if m == 1:  # G_ref = 0: these are already the rows decayed from the chunk start
        return (BlockLower(diag_qk, []), BlockLower(diag_kk, []), q_off.view(P, C, K), k_off.view(P, C, K),
                base.view(P, C, K), decay_exp(G[:, -1]))

    # Gamma = exp(G_r - G_ref(a)) exp(G_ref(a)): each factor is flushed below exp(floor), so a kept
    # product is above exp(2 floor), a normal number.
    from_start = decay_exp(G_ref).unsqueeze(2)  # [P, m, 1, K]
    q_start, k_start = (q_off * from_start).view(P, C, K), (k_off * from_start).view(P, C, K)
    cross = decay_exp((G_ref.unsqueeze(2) - G_end.unsqueeze(1)).clamp(max=0.0))  # [P, m(a), m(b), K]
    below_qk, below_kk = [], []
    for a in range(1, m):
        cols = (base[:, :a] * cross[:, a, :a].unsqueeze(2)).reshape(P, a * s, K).transpose(-1, -2)
        below_qk.append(q_off[:, a] @ cols)
        below_kk.append(k_off[:, a] @ cols)
    # k_end = k_i exp(G_end(b) - G_i) exp(G_C - G_end(b))
    k_end = (base * decay_exp(G_end[:, -1:] - G_end).unsqueeze(2)).view(P, C, K)
    return (BlockLower(diag_qk, below_qk), BlockLower(diag_kk, below_kk), q_start, k_start, k_end,
            decay_exp(G[:, -1]))


def _state_scan(W, U0, K_end, decay_end, S0, buffer=None):
    """The only sequential part: for each chunk i (in order),
        U_i = U0_i - W_i S_i,     S_{i+1} = Diag(decay_end_i) S_i + K_end_i^T U_i.
    W, K_end [n, M, C, K]; U0 [n, M, C, V]; decay_end None | [n, M, K|1]; S0 [M, K, V].
    Returns U [n, M, C, V] and the states S_0..S_n stacked [n+1, M, K, V] (in `buffer` when given and
    no gradient is needed)."""
    n = W.shape[0]
    K_end_T = K_end.transpose(-1, -2)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (W, U0, K_end, decay_end, S0))
    if needs_grad:
        # chunks taken by unbind, not by indexing: the backward of x[i] writes its gradient into a zeroed
        # copy of the whole x, once per chunk; unbind's stacks the chunks' gradients once
        decays = (None,) * n if decay_end is None else decay_end.unsqueeze(-1).unbind(0)
        states, corrections = [S0], []
        for U0_i, W_i, KT_i, d_i in zip(U0.unbind(0), W.unbind(0), K_end_T.unbind(0), decays):
            U_i = torch.baddbmm(U0_i, W_i, states[-1], alpha=-1.0)
            S = states[-1] if d_i is None else states[-1] * d_i
            states.append(torch.baddbmm(S, KT_i, U_i))
            corrections.append(U_i)
        return torch.stack(corrections), torch.stack(states)
    # Inference: update U0 in place into U, states into one preallocated buffer.
    # `buffer` (reused across slabs) spares re-touching fresh pages: page faults on first write into a
    # new allocation would otherwise cost more than the small matmuls themselves.
    states = U0.new_empty(n + 1, *S0.shape) if buffer is None else buffer[: n + 1]
    states[0].copy_(S0)
    S_all, U_all, W_all, KT_all = states.unbind(0), U0.unbind(0), W.unbind(0), K_end_T.unbind(0)
    d_all = (None,) * n if decay_end is None else decay_end.unsqueeze(-1).unbind(0)
    for S, S_next, U, W_i, KT, d in zip(S_all, S_all[1:], U_all, W_all, KT_all, d_all):
        U.baddbmm_(W_i, S, alpha=-1.0)
        if d is None:
            S_next.copy_(S)
        else:
            torch.mul(S, d, out=S_next)
        S_next.baddbmm_(KT, U)
    return U0, states


def chunk_delta(q, k, v, beta, *, g=None, initial_state=None, scale: float, chunk_size: int):
    """The delta rule over chunks of `chunk_size` tokens (any T: the last chunk is padded with no-op
    steps). Inputs already validated and in the accumulation dtype (`k3.ops.delta_family`).

    q, k [N,T,H,K]; v [N,T,H,V]; beta [N,T,H]; g None (DeltaNet), [N,T,H] (Gated DeltaNet) or
    [N,T,H,K] (KDA) log decay; initial_state None or [N,H,K,V].
    Returns (o [N,T,H,V], final state [N,H,K,V]), ordinary tensors even when run in inference mode.

    A NaN or inf in k, v or beta reaches no earlier output (`k3.ops.common.keep_causal`; q only ever
    reaches its own row, and g is a validated log decay whose -inf is clamped)."""
    onwards = nonfinite_onwards(k, v, beta)
    o, S = _chunk_delta(q, k, v, beta, g, initial_state, scale, chunk_size)
    return keep_causal(o, onwards, lambda zero: _chunk_delta(q, zero(k), zero(v), zero(beta), zero(g),
                                                              initial_state, scale, chunk_size)[0]), S


def _chunk_delta(q, k, v, beta, g, S0, scale: float, chunk_size: int):
    """`chunk_delta` for inputs whose rows are taken as they are."""
    N, T, H, K = q.shape
    V = v.shape[-1]
    if T == 0:
        S = q.new_zeros(N, H, K, V) if S0 is None else S0
        return v.new_zeros(N, 0, H, V), S
    C = min(chunk_size, T)
    pad = (-T) % C
    if pad:  # neutral padding: q = k = v = 0, beta = 0, g = 0 leave the state untouched
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        beta = F.pad(beta, (0, 0, 0, pad))
        if g is not None:
            g = F.pad(g, (0, 0, 0, 0, 0, pad) if g.dim() == 4 else (0, 0, 0, pad))
    n, M = (T + pad) // C, N * H
    chunked = lambda x: x.reshape(N, n, C, H, -1)  # noqa: E731  [N, n, C, H, d], a view
    q, k, v, beta = chunked(q), chunked(k), chunked(v), chunked(beta)
    if g is not None:
        g = chunked(g)

    S = q.new_zeros(M, K, V) if S0 is None else S0.reshape(M, K, V)
    o = q.new_empty(N, n, C, H, V)  # allocated outside inference mode: an ordinary tensor for the caller
    # Chunks are processed in slabs of about SLAB_ELEMENTS values per tensor, laid out chunk-major
    # [slab chunks, N*H, C, d] only there: temporaries stay cache-sized and memory flat in T.
    per_slab = max(1, SLAB_ELEMENTS // (M * C * max(K, V)))
    with inference_unless_grad(q, k, v, beta, g, S0):
        buffer = q.new_empty(min(per_slab, n) + 1, M, K, V)
        for i in range(0, n, per_slab):
            part = slice(i, i + per_slab)
            slab = lambda x: x[:, part].permute(1, 0, 3, 2, 4).reshape(-1, M, C, x.shape[-1])  # noqa: E731
            # G: cumulative log decay within each chunk (clamped so that g = -inf stays finite)
            G = None if g is None else slab(g).clamp(min=LOG_DECAY_FLOOR[q.dtype]).cumsum(dim=-2)
            o_part, S = _chunk_slab(slab(q), slab(k), slab(v), slab(beta), G, S, scale, buffer)
            o[:, part] = o_part.view(-1, N, H, C, V).permute(1, 0, 3, 2, 4)
    # the clone, made outside inference mode, is an ordinary tensor and not a view into `buffer`
    return o.view(N, n * C, H, V)[:, :T], S.reshape(N, H, K, V).clone()


def _chunk_slab(q, k, v, beta, G, S, scale: float, states_buffer=None):
    """One slab of consecutive chunks. q, k [n, M, C, K] (q not yet scaled); v [n, M, C, V];
    beta [n, M, C, 1]; G None | [n, M, C, K|1] cumulative log decay within each chunk; S [M, K, V]
    state before the slab. Returns o [n, M, C, V] and the state after the slab."""
    n, M, C, K = q.shape
    V = v.shape[-1]
    flat = lambda x: x.reshape(n * M, *x.shape[2:])  # noqa: E731
    intra = _intra_channel_gate if G is not None and G.shape[-1] > 1 else _intra_scalar_gate
    A_qk, A_kk, q_start, k_start, k_end, decay_end = intra(flat(q), flat(k), None if G is None else flat(G))
    if decay_end is not None:
        decay_end = decay_end.view(n, M, -1)

    # UT transform: T = (I + Diag(beta) A_kk)^-1; W = T Diag(beta) (K * Gamma), U0 = T Diag(beta) V.
    beta = flat(beta)
    W, U0 = A_kk.scale_rows(beta).unit_solve(k_start, flat(v), column_scale=beta)
    W, U0 = W.view(n, M, C, K), U0.view(n, M, C, V)

    U, states = _state_scan(W, U0, k_end.view(n, M, C, K), decay_end, S, states_buffer)
    # o = scale * ((Q * Gamma) S + A_qk U): the scale rides on the matmuls
    o = q_start.view(n, M, C, K) @ states[:-1]
    A_qk.addmm_(o.view(n * M, C, V), U.view(n * M, C, V), beta=scale, alpha=scale)
    return o.view(n, M, C, V), states[-1]

