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
slab at once (the gates' scores in `k3.ops.gates`, the UT transform in `k3.ops.ut`); only the
chunk-to-chunk state update is a loop (`k3.ops.scan`). With a gradient to take, `ChunkDelta` runs the
same forward and its own backward (`k3.ops.chunk_backward`).

Numerics. No ratio of cumulative decay products (the article's gamma_r / gamma_i) is ever formed over
a chunk: exponents are differences G_r - G_i, taken where they are <= 0, KDA's per-channel scores
included (factored through gates between r and i, each factor <= 1: `k3.ops.gates`), so nothing
depends on the gates' range and nothing is read back from the device to choose a path. Negligible
decay factors and UT entries are flushed to zero (see `k3.ops.numerics`).
"""

from __future__ import annotations

import contextlib
import itertools
import threading

import torch
import torch.nn.functional as F

from .chunk_backward import slab_backward
from .common import keep_causal, nonfinite_onwards
from .gates import gate_from_tensors, gate_of, gate_tensors, lower_masks, sub_chunk_size
from .numerics import halving_bound, log_decay_floor
from .scan import state_scan
from .ut import BlockLower

SLAB_ELEMENTS = 1 << 18  # values per tensor in one slab of chunks

_autograd_through_forward = threading.local()


@contextlib.contextmanager
def autograd_through_forward():
    """Within this context (this thread), the chunk forms leave their backward to autograd through the
    forward's ops instead of `ChunkDelta`'s: the reference `k3 bench backward` and the tests measure
    the own backward against."""
    before = getattr(_autograd_through_forward, "on", False)
    _autograd_through_forward.on = True
    try:
        yield
    finally:
        _autograd_through_forward.on = before


def chunk_delta(
    q,
    k,
    v,
    beta,
    *,
    g=None,
    initial_state=None,
    scale: float,
    chunk_size: int,
    guard: bool = True,
    lower_bound: float | None = None,
):
    """The delta rule over chunks of `chunk_size` tokens (any T: the last chunk is padded with no-op
    steps). Inputs already validated and in the accumulation dtype (`k3.ops.delta_family`).

    q, k [N,T,H,K]; v [N,T,H,V]; beta [N,T,H]; g None (DeltaNet), [N,T,H] (Gated DeltaNet) or
    [N,T,H,K] (KDA) log decay; initial_state None or [N,H,K,V]; lower_bound None or a float < 0 that
    every step's g is at least (a g below it is taken as lower_bound): lets KDA's gate factor its
    sub-chunks in fewer, larger blocks (`k3.ops.gates.ChannelGate`).
    Returns (o [N,T,H,V], final state [N,H,K,V]), ordinary tensors even when run in inference mode.

    With `guard`, a NaN or inf in k, v or beta reaches no earlier output (`k3.ops.common.keep_causal`; q
    only ever reaches its own row, and g is a validated log decay whose -inf is clamped)."""
    onwards = nonfinite_onwards(k, v, beta) if guard else None
    run = lambda k, v, beta, g: _chunk_delta(q, k, v, beta, g, initial_state, scale, chunk_size, lower_bound)  # noqa: E731
    o, S = run(k, v, beta, g)
    return keep_causal(o, onwards, lambda zero: run(zero(k), zero(v), zero(beta), zero(g))[0]), S


def _chunk_delta(q, k, v, beta, g, S0, scale: float, chunk_size: int, lower_bound: float | None = None):
    """`chunk_delta` for inputs whose rows are taken as they are."""
    N, T, H, K = q.shape
    V = v.shape[-1]
    if T == 0 or N == 0:  # nothing to mix (no chunk to reshape into): an empty output, the state as given
        S = q.new_zeros(N, H, K, V) if S0 is None else S0
        return v.new_zeros(N, T, H, V), S
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
    if g is not None:  # clamped so that g = -inf stays finite; summed within each chunk slab by slab
        g = _clamped(chunked(g), log_decay_floor(q.dtype, lower_bound))
        lower_bound = halving_bound(g, lower_bound)  # (stated, or read from a gate in host memory)
    S0 = None if S0 is None else S0.reshape(M, K, V)
    # Chunks are processed in slabs of about SLAB_ELEMENTS values per tensor, laid out chunk-major
    # [slab chunks, N*H, C, d] only there: temporaries stay cache-sized and memory flat in T.
    per_slab = max(1, SLAB_ELEMENTS // (M * C * max(K, V)))
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, beta, g, S0)):
        if getattr(_autograd_through_forward, "on", False):
            o, S = _chunk_forward(q, k, v, beta, g, S0, scale, per_slab, lower_bound)
        else:
            o, S = ChunkDelta.apply(q, k, v, beta, g, S0, scale, per_slab, lower_bound)
    else:
        o = q.new_empty(N, n, C, H, V)  # allocated outside inference mode: an ordinary tensor for the caller
        with torch.inference_mode():
            o, S = _chunk_forward(q, k, v, beta, g, S0, scale, per_slab, lower_bound, out=o)
    # the clone, made outside inference mode, is an ordinary tensor and not a view into a scan buffer
    return o.view(N, n * C, H, V)[:, :T], S.reshape(N, H, K, V).clone()


def _clamped(g: torch.Tensor, floor: float) -> torch.Tensor:
    """g clamped from below at `floor`, so that g = -inf stays finite in the cumulative sums (the values
    above it unchanged, their gradient passed through)."""
    return g.clamp(min=floor)


def _reverse_cumsum_within_chunks(x: torch.Tensor) -> torch.Tensor:
    """sum_{j >= i} x_j over each chunk's positions (dim -2 of x [..., C, d]): the backward of the
    chunk-local cumulative sum. Per channel (d > 1) as one product with the upper-triangular ones
    matrix, which passes over x once where flip, cumsum, flip pass three times."""
    if x.shape[-1] == 1:
        return x.flip(-2).cumsum(-2).flip(-2)
    return lower_masks(x.shape[-2], x.dtype, x.device)[0].mT @ x


def _slabs(n: int, per_slab: int, N: int, H: int):
    """(part, slab, unslab) for each slab of chunks: `slab(x)` takes x [N, n, C, H, d] to the slab's
    chunk-major [chunks, N*H, C, d] (a copy), `unslab(y)` lays such a result back as [N, chunks, C, H, d]."""
    for i in range(0, n, per_slab):
        part = slice(i, i + per_slab)
        yield (
            part,
            lambda x, part=part: x[:, part].permute(1, 0, 3, 2, 4).reshape(-1, N * H, x.shape[2], x.shape[-1]),
            lambda y: y.view(-1, N, H, *y.shape[-2:]).permute(1, 0, 3, 2, 4),
        )


def _chunk_forward(
    q, k, v, beta, g, S0, scale: float, per_slab: int, lower_bound=None, saved: list | None = None, out=None
):
    """The slabs in order. q, k [N, n, C, H, K]; v [N, n, C, H, V]; beta [N, n, C, H, 1]; g None |
    [N, n, C, H, K|1] the log decays (summed within each chunk here: G, slab by slab, in cache);
    S0 None | [N*H, K, V]. Returns (o [N, n, C, H, V], final state [N*H, K, V]).
    With `saved` a list, appends what the backward keeps of each slab (`_chunk_slab`'s `keep`); o is
    written into `out` when given."""
    N, n, C, H, K = q.shape
    V = v.shape[-1]
    S = q.new_zeros(N * H, K, V) if S0 is None else S0
    o = q.new_empty(N, n, C, H, V) if out is None else out
    # one state buffer reused by every slab; when the backward keeps the states, each slab's own
    buffer = q.new_empty(min(per_slab, n) + 1, N * H, K, V) if saved is None else None
    for part, slab, unslab in _slabs(n, per_slab, N, H):
        inputs = [slab(x) for x in (q, k, v, beta)] + ([] if g is None else [slab(g).cumsum(dim=-2)])
        # the backward keeps the slab's inputs (G for g) in its own layout, so that it need not lay them out again
        keep = None if saved is None else list(inputs)
        G = None if g is None else inputs[4]
        o_part, S = _chunk_slab(*inputs[:4], G, S, scale, buffer, keep, lower_bound)
        o[:, part] = unslab(o_part)
        if saved is not None:
            saved.append(keep)
    return o, S


class ChunkDelta(torch.autograd.Function):
    """The chunkwise delta rule with its own backward (`k3.ops.chunk_backward`), after fla's split: the
    forward keeps per slab its inputs (in the slab's layout, G for g), the two C x C matrices of each
    chunk (A_qk and the UT inverse T), W, U, the state entering each chunk and the gate's decay factors
    (`k3.ops.gates.gate_tensors`); the backward recomputes only the rows decayed by those factors, then
    runs the chunks in reverse, its temporaries in inference mode. Autograd through the forward would keep
    every intermediate of every chunk and replay hundreds of small ops."""

    @staticmethod
    def forward(ctx, q, k, v, beta, g, S0, scale: float, per_slab: int, lower_bound: float | None):
        saved: list = []
        o, S = _chunk_forward(q, k, v, beta, g, S0, scale, per_slab, lower_bound, saved)
        # each slab's gate: its factors saved with the rest (so that saved-tensor hooks, as activation
        # recompute's, see them), its other state on ctx
        ctx.gates = []
        for keep in saved:
            names, tensors, rest = gate_tensors(keep.pop())
            keep += tensors
            ctx.gates.append((names, rest))
        ctx.save_for_backward(*(x for keep in saved for x in keep))
        ctx.scale, ctx.per_slab, ctx.S0_shape = scale, per_slab, None if S0 is None else S0.shape
        ctx.shapes, ctx.gated = (q.shape, v.shape, beta.shape, None if g is None else g.shape), g is not None
        return o, S.clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dS):
        kept = ctx.saved_tensors
        qk_shape, v_shape, beta_shape, g_shape = ctx.shapes
        N, n, C, H, K = qk_shape
        new = lambda shape: do.new_empty(shape)  # noqa: E731
        dq, dk, dv, dbeta = new(qk_shape), new(qk_shape), new(v_shape), new(beta_shape)
        dg = None if g_shape is None else new(g_shape)
        slabs = list(_slabs(n, ctx.per_slab, N, H))
        m = C // sub_chunk_size(C)
        ins = 5 if ctx.gated else 4
        per = ins + 2 * m + 3  # the inputs, A_qk's and T's blocks, W, U, the chunk states; then the gate's
        ends = list(itertools.accumulate(per + len(names) for names, _ in ctx.gates))
        # the slabs' temporaries as inference tensors (no version counters or autograd metadata: 2-7%
        # of forward + backward here); the gradients go into the ordinary tensors allocated above
        eager = not torch.compiler.is_compiling()
        with torch.inference_mode() if eager else contextlib.nullcontext():
            for j in reversed(range(len(slabs))):
                part, slab, unslab = slabs[j]
                names, rest = ctx.gates[j]
                start = ends[j] - per - len(names)
                *own, W, U, states = kept[start : start + per]
                gate = gate_from_tensors(names, kept[start + per : ends[j]], rest)
                inputs, blocks = own[:ins], own[ins:]
                A_qk, T = BlockLower(blocks[0], blocks[1:m]), BlockLower(blocks[m], blocks[m + 1 :])
                G = inputs[4] if ctx.gated else None
                (dq_s, dk_s, dv_s, dbeta_s, dG_s), dS = slab_backward(
                    *inputs[:4], G, gate, states, A_qk, T, W, U, slab(do), dS, ctx.scale
                )
                grads = (dq_s, dk_s, dv_s, dbeta_s, None if dG_s is None else _reverse_cumsum_within_chunks(dG_s))
                for out, grad in zip((dq, dk, dv, dbeta, dg), grads):
                    if out is not None:
                        out[:, part] = unslab(grad)
        dS = None if ctx.S0_shape is None else (dS.clone() if eager else dS)  # an ordinary tensor
        return dq, dk, dv, dbeta, dg, dS, None, None, None


def _chunk_slab(q, k, v, beta, G, S, scale: float, states_buffer=None, keep: list | None = None, lower_bound=None):
    """One slab of consecutive chunks. q, k [n, M, C, K] (q not yet scaled); v [n, M, C, V];
    beta [n, M, C, 1]; G None | [n, M, C, K|1] cumulative log decay within each chunk; S [M, K, V]
    state before the slab. Returns o [n, M, C, V] and the state after the slab; appends the blocks of
    A_qk and of the UT inverse T (`BlockLower` [n*M, C, C]) to `keep` when given."""
    n, M, C, K = q.shape
    V = v.shape[-1]
    flat = lambda x: x.reshape(n * M, *x.shape[2:])  # noqa: E731
    gate = gate_of(None if G is None else flat(G), C, q.dtype, q.device, lower_bound)
    A_qk, A_kk, q_start, k_start, k_end, decay_end = gate.intra(flat(q), flat(k))
    if decay_end is not None:
        decay_end = decay_end.view(n, M, -1)

    # UT transform: T = (I + Diag(beta) A_kk)^-1; W = T Diag(beta) (K * Gamma), U0 = T Diag(beta) V.
    beta = flat(beta)
    T = A_kk.scale_rows(beta).unit_inverse()
    W, U0 = T.scale_columns(beta).matmul(k_start, flat(v))
    W, U0 = W.view(n, M, C, K), U0.view(n, M, C, V)
    if keep is not None:
        keep += [A_qk.diag, *A_qk.below, T.diag, *T.below]

    U, states = state_scan(W, U0, k_end.view(n, M, C, K), decay_end, S, states_buffer)
    if keep is not None:
        # W, U (U0 updated in place), each chunk's incoming state (a copy if the scan's buffer is reused)
        # and, last, the gate with its decay factors
        keep += [W, U, states[:-1] if states_buffer is None else states[:-1].clone(), gate]
    # o = scale * ((Q * Gamma) S + A_qk U): the scale rides on the matmuls
    o = q_start.view(n, M, C, K) @ states[:-1]
    A_qk.addmm_(o.view(n * M, C, V), U.view(n * M, C, V), beta=scale, alpha=scale)
    return o.view(n, M, C, V), states[-1]
