"""The delta-rule family's shared machinery: DeltaNet, Gated DeltaNet and KDA are one recurrence.

Per head, with row vectors q, k in R^K, v in R^V, a per-channel decay a_t = exp(g_t) in (0, 1]^K
(a scalar broadcast over channels for Gated DeltaNet, 1 for DeltaNet) and a write strength beta_t:

    S' = Diag(a_t) S_{t-1}
    S_t = S' + beta_t k_t^T (v_t - k_t S')            o_t = scale * q_t S_t

`delta_recurrence` is that loop, token by token: the reference, and the decode step.

`chunk_delta` is the chunkwise-parallel form (the article's `chunk_delta_rule_forward`, generalised to
gates). Inside a chunk of C tokens, with cumulative log decays G_i = g_1 + ... + g_i from the chunk start
and Gamma_i = exp(G_i), the state at position r is

    S_r = Diag(Gamma_r) S_0 + sum_{i<=r} Diag(exp(G_r - G_i)) k_i^T u_i,

where the corrections u solve the unit-lower-triangular system (the UT / WY transform)

    (I + A) U = Diag(beta) (V - (K * Gamma) S_0),   A_ri = beta_r sum_c k_rc k_ic exp(G_rc - G_ic), i < r,

so U = U0 - W S_0 with W = (I + A)^-1 Diag(beta) (K * Gamma) and U0 = (I + A)^-1 Diag(beta) V. Then

    O   = (Q * Gamma) S_0 + tril(Aqk) U,         Aqk_ri = sum_c q_rc k_ic exp(G_rc - G_ic)
    S_C = Diag(Gamma_C) S_0 + (K * exp(G_C - G))^T U.

Everything but the last two lines is independent of S_0, so it runs for all chunks and heads of a
slab at once; only the chunk-to-chunk state update is a loop.

Numerics. No ratio of cumulative decay products (the article's gamma_r / gamma_i) is ever formed over
a chunk: exponents are differences G_r - G_i, taken where they are <= 0. The exception is KDA's
per-channel scores inside one sub-chunk of up to 32 tokens, factored as x_r exp(G_r - G_mid) times
k_i exp(G_mid - G_i) around the gate at its middle; a check bounds those exponents
(|.| <= 80 in fp32), and any sub-chunk past the bound is computed pairwise, exactly. Decay factors
below exp(-24) (fp32) / exp(-300) (fp64) are flushed to zero, and so are entries of the UT matrix and
its inverse below 2^-40 (fp32) / 2^-100 (fp64): they are below the dtype's resolution, and kept they
sink into subnormal numbers that make every matmul touching them ~100x slower on x86 CPUs
(torch.set_flush_denormal reaches only the calling thread, not the intra-op workers).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .common import (
    LOG_DECAY_FLOOR, check_chunk_size, check_cu_seqlens, check_log_decay, check_qkv, check_scale,
    check_state, check_tensor, compute_dtype, inference_unless_grad, l2norm, run_packed,
)

# Largest |exponent| allowed in a factored exp(G_r - G_mid) * exp(G_mid - G_i): each factor stays a
# normal number (fp32 normals reach exp(-87)).
_FACTOR_EXP_LIMIT = {torch.float32: 80.0, torch.float64: 600.0}
# Decay factors below exp(floor) are flushed to exactly 0. They are below the dtype's resolution
# (exp(-24) ~ 4e-11 against fp32's 6e-8; exp(-300) against fp64's 1e-16). Kept, their products with
# other small factors become subnormal numbers, which make matmuls ~100x slower on x86 CPUs (and
# torch.set_flush_denormal reaches only the calling thread, not the intra-op worker threads).
_DECAY_FLUSH = {torch.float32: -24.0, torch.float64: -300.0}
_SUB_CHUNK = 32
_SLAB_ELEMENTS = 1 << 18


def decay_exp(x: torch.Tensor, floor: float | None = None) -> torch.Tensor:
    """exp(x), flushed to exactly 0 where x < floor (default: the dtype's negligible-decay floor)."""
    floor = _DECAY_FLUSH[x.dtype] if floor is None else floor
    # clamp first: exp of very negative inputs would itself produce (slow) subnormals
    return F.threshold(torch.exp(x.clamp(min=floor - 1.0)), math.exp(floor), 0.0)


def delta_recurrence(q, k, v, beta, g, S0, scale: float):
    """Token-by-token delta rule. q, k [N,T,H,K], v [N,T,H,V], beta [N,T,H],
    g None | [N,T,H] | [N,T,H,K] log decay, S0 None | [N,H,K,V]. Returns (o [N,T,H,V], S [N,H,K,V])."""
    N, T, H, K = q.shape
    S = q.new_zeros(N, H, K, v.shape[-1]) if S0 is None else S0
    if T == 0:
        return v.new_zeros(N, 0, H, v.shape[-1]), S
    outputs = []
    with inference_unless_grad(q, k, v, beta, g, S0):
        if g is not None:
            decay = torch.exp(g if g.dim() == 4 else g.unsqueeze(-1)).unsqueeze(-1)  # [N,T,H,K|1,1]
        for t in range(T):
            if g is not None:
                S = S * decay[:, t]  # S' = Diag(a_t) S_{t-1}
            k_t = k[:, t].unsqueeze(-1)  # [N,H,K,1]
            v_old = (k_t * S).sum(-2)  # k_t S'  [N,H,V]
            S = S + k_t * (beta[:, t, :, None] * (v[:, t] - v_old)).unsqueeze(-2)
            outputs.append((q[:, t].unsqueeze(-2) @ S).squeeze(-2))
    # made out here, so that the caller gets ordinary tensors
    return torch.stack(outputs, dim=1) * scale, (S.clone() if S.is_inference() else S)


# ----------------------------------------------------------------------------------------------------
# chunkwise-parallel form


@lru_cache(maxsize=64)
def _lower_masks(C: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """0/1 lower-triangular masks [C, C]: inclusive (q rows: i <= r) and strict (k rows: i < r).
    Ordinary tensors even when first asked for in inference mode, so that autograd can save them."""
    with torch.inference_mode(False):
        incl = torch.ones(C, C, dtype=dtype, device=device).tril()
        return incl, incl.tril(-1)


def _sub_chunk_size(C: int) -> int:
    return max(s for s in range(1, min(_SUB_CHUNK, C) + 1) if C % s == 0)


def _intra_scalar_gate(q, k, G):
    """Everything inside a chunk that does not depend on the incoming state, for a scalar gate per
    head (G [P, C, 1] cumulative log decay) or none (G None). q, k [P, C, K].

    Returns A_qk (incl. diagonal) and A_kk (strict) as `BlockLower` [P, C, C], q * Gamma, k * Gamma,
    k * exp(G_C - G) [P, C, K] and exp(G_C) [P, 1] (None without a gate)."""
    C = q.shape[-2]
    incl, strict = _lower_masks(C, q.dtype, q.device)
    k_t = k.transpose(-1, -2)
    s = _sub_chunk_size(C)
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
    s = _sub_chunk_size(C)
    m = C // s
    limit, flush = _FACTOR_EXP_LIMIT[q.dtype], _DECAY_FLUSH[q.dtype]
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


def _flush_tiny(x: torch.Tensor) -> torch.Tensor:
    """Zero the entries of a dimensionless matrix (relative to an identity) below 2^-40 (fp32) or
    2^-100 (fp64): over 10^4 times below the dtype's resolution, and large enough that products of up
    to three kept entries are still normal numbers (not slow subnormals)."""
    return F.hardshrink(x, 2.0 ** (-40 if x.dtype == torch.float32 else -100))


class BlockLower(NamedTuple):
    """A lower-triangular [P, C, C] matrix kept as blocks of s rows and columns (C = m s): the
    diagonal blocks diag [P, m, s, s] and, for each row block a >= 1, the part left of its diagonal
    block below[a - 1] [P, s, a s]. Above the diagonal blocks it is zero, and never stored."""

    diag: torch.Tensor
    below: list[torch.Tensor]

    @staticmethod
    def split(A: torch.Tensor, s: int) -> "BlockLower":
        P, C, _ = A.shape
        m = C // s
        diag = A.view(P, m, s, m, s).diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2)
        return BlockLower(diag, [A[:, a * s:(a + 1) * s, :a * s] for a in range(1, m)])

    def scale_rows(self, x: torch.Tensor) -> "BlockLower":
        """Diag(x) L for x [P, C, 1]."""
        P, m, s, _ = self.diag.shape
        x = x.view(P, m, s, 1)
        return BlockLower(self.diag * x, [b * x[:, a] for a, b in enumerate(self.below, start=1)])

    def addmm_(self, out: torch.Tensor, X: torch.Tensor, beta: float = 1.0, alpha: float = 1.0) -> torch.Tensor:
        """out <- beta out + alpha L X, in place; X, out [P, C, d]."""
        P, m, s, _ = self.diag.shape
        d = X.shape[-1]
        out.view(P * m, s, d).baddbmm_(self.diag.reshape(P * m, s, s), X.reshape(P * m, s, d),
                                       beta=beta, alpha=alpha)
        for a, block in enumerate(self.below, start=1):
            # into a fresh product first: baddbmm_ into a row slice is ~3x slower on CPU
            out[:, a * s:(a + 1) * s].add_(block @ X[:, :a * s], alpha=alpha)
        return out

    def unit_solve(self, *rhs: torch.Tensor, column_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """T D X for T = (I + L)^-1 (strictly lower L: the UT transform), D = Diag(column_scale [P, C, 1])
        (identity when None) and each X [P, C, d] of `rhs`,
        with T kept in row blocks: one batched triangular solve inverts the diagonal blocks T_aa,
        each block row left of the diagonal follows from the ones above it,
        T_a,<a = -T_aa L_a,<a T_<a,<a, and (T X)_a = T_a,<a X_<a + T_aa X_a. Flushing tiny entries of
        these dimensionless blocks between the stages keeps subnormal numbers out (one solve over all
        C rows is ~2x slower in practice for that reason)."""
        P, m, s, _ = self.diag.shape
        eye = torch.eye(s, dtype=self.diag.dtype, device=self.diag.device).expand(P, m, s, s)
        # X (I + L_aa) = I gives the same inverse as (I + L_aa) X = I; on CPU the right-hand solve
        # on a contiguous copy runs ~1.8x faster
        inv = _flush_tiny(torch.linalg.solve_triangular(_flush_tiny(self.diag.contiguous()), eye,
                                                        upper=False, left=False, unitriangular=True))
        lefts: list[torch.Tensor] = []  # T_a,<a for a >= 1
        for a, block in enumerate(self.below, start=1):
            above = inv[:, 0] if a == 1 else _stack_rows(
                [inv[:, 0]] + [torch.cat([left, inv[:, i]], dim=-1) for i, left in enumerate(lefts, start=1)], a * s)
            lefts.append(_flush_tiny(-inv[:, a] @ (_flush_tiny(block) @ above)))
        if column_scale is not None:  # T D: scale the columns of the small blocks, not the rows of X
            inv = inv * column_scale.view(P, m, s, 1).transpose(-1, -2)
            lefts = [left * column_scale[:, : a * s].transpose(-1, -2) for a, left in enumerate(lefts, start=1)]
        results = []
        for X in rhs:
            parts = X.split(s, dim=1)
            out = [inv[:, 0] @ parts[0]]
            out += [torch.baddbmm(inv[:, a] @ parts[a], left, X[:, : a * s]) for a, left in enumerate(lefts, start=1)]
            results.append(out[0] if m == 1 else torch.cat(out, dim=1))
        return tuple(results)


def _stack_rows(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """Row blocks of growing width, zero-padded on the right to `width` and stacked."""
    return torch.cat([F.pad(r, (0, width - r.shape[-1])) for r in rows], dim=1)


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
        states, corrections = [S0], []
        for i in range(n):
            U_i = torch.baddbmm(U0[i], W[i], states[i], alpha=-1.0)
            S = states[i] if decay_end is None else states[i] * decay_end[i].unsqueeze(-1)
            states.append(torch.baddbmm(S, K_end_T[i], U_i))
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


def chunk_delta(q, k, v, beta, g, S0, scale: float, chunk_size: int):
    """Chunkwise-parallel delta rule; same arguments and result as `delta_recurrence`.

    g None (DeltaNet), [N,T,H] (Gated DeltaNet) or [N,T,H,K] (KDA); S0 None or [N,H,K,V].
    """
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
    # Chunks are processed in slabs of about _SLAB_ELEMENTS values per tensor, laid out chunk-major
    # [slab chunks, N*H, C, d] only there: temporaries stay cache-sized and memory flat in T.
    per_slab = max(1, _SLAB_ELEMENTS // (M * C * max(K, V)))
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


# ----------------------------------------------------------------------------------------------------
# the public ops' common front door


def run_delta_op(op: str, form, q, k, v, g, gate: str | None, beta, scale, initial_state,
                 output_final_state: bool, cu_seqlens, use_qk_l2norm: bool, chunk_size: int | None):
    """Validate, cast to the accumulation dtype, pack/unpack `cu_seqlens`, and run `form`
    (`delta_recurrence` or `chunk_delta`). `gate` is None, "head" (g [B,T,H]) or "channel" (g [B,T,H,K])."""
    B, T, H, K, V = check_qkv(op, q, k, v)
    if gate == "head":
        check_tensor(op, "g", g, (B, T, H), q)
    elif gate == "channel":
        check_tensor(op, "g", g, (B, T, H, K), q)
    check_tensor(op, "beta", beta, (B, T, H), q)
    cu_seqlens = check_cu_seqlens(op, cu_seqlens, B, T, q.device)
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    S0 = check_state(op, "initial_state", initial_state, (N, H, K, V), q)
    scale = check_scale(op, scale, K)
    if chunk_size is not None:
        chunk_size = check_chunk_size(op, chunk_size)
    if g is not None:
        check_log_decay(op, g)

    in_dtype, dtype = q.dtype, compute_dtype(q.dtype)
    q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    g = None if g is None else g.to(dtype)

    def run(q, k, v, beta, g):
        if chunk_size is None:
            return form(q, k, v, beta, g, S0, scale)
        return form(q, k, v, beta, g, S0, scale, chunk_size)

    o, S = run_packed(run, cu_seqlens, q, k, v, beta, g)
    return o.to(in_dtype), (S if output_final_state else None)
