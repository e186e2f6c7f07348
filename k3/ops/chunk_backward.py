"""The chunkwise delta rule's backward, one slab of chunks at a time (fla's stages, unfused).

The forward of a slab (`k3.ops.chunk`), per chunk, with Gamma = exp(G) the decays from the chunk start:

    A_qk = q | k (incl.),  L = Diag(beta) (k | k) (strict),  T = (I + L)^-1     (`k3.ops.gates` scores)
    W = T Diag(beta) (k * Gamma),   U0 = T Diag(beta) v                       (UT transform)
    U_i = U0_i - W_i S_i,   S_{i+1} = Diag(exp G_C) S_i + (k * exp(G_C - G))^T U_i   (`k3.ops.scan`)
    o = scale ((q * Gamma) S_i + A_qk U_i)

Kept from the forward: the slab's inputs (G for g), A_qk and T (as blocks), W, U and the state entering
each chunk, and the gate with its decay factors (`gate`). Then, with do the gradient of o and dS that of
the slab's outgoing state:

1. dU = scale A_qk^T do, and the scan in reverse (`state_scan_backward`) adds K_end dS_{i+1} and gives
   dS_i = Diag(exp G_C) dS_{i+1} + scale (q * Gamma)^T do - W^T dU;
2. the chunk-local products: d(q * Gamma) = scale do S^T, dA_qk = scale tril(do U^T),
   d(k * exp(G_C - G)) = U dS_{i+1}^T, d exp(G_C) = sum_v S_i * dS_{i+1};
3. the UT transform. Per chunk U solves (I + L) U = Diag(beta) (v - (k * Gamma) S) = X_v - X_k S, so
   with dX_v = T^T dU: dv = beta dX_v, d(beta k * Gamma) = -dX_v S^T and dL = -dX_v U^T below the
   diagonal (U0 and W = T X_k never enter: fla's dA = -(dv_new u^T) in the same form);
4. the gated scores' gradients (`k3.ops.gates`: dx = lower(dA, y), dy = upper(dA, x), dG = x dx - y dy),
   and the decays' own: x * exp(G) gives dG += x exp(G) d(x exp(G)), and so on.
dG is the gradient w.r.t. the cumulative gate G; `ChunkDelta`'s reverse cumulative sum takes it to g.
"""

from __future__ import annotations

import torch

from .scan import state_scan_backward
from .ut import BlockLower


def slab_backward(q, k, v, beta, G, gate, states, A_qk, T, W, U, do, dS, scale: float):
    """Gradients of one slab. q, k [n, M, C, K] (q not yet scaled); v, do [n, M, C, V]; beta [n, M, C, 1];
    G None | [n, M, C, K|1]; gate the slab's gate (`k3.ops.gates`, as the forward kept it); states
    [n, M, K, V] the state entering each chunk; A_qk, T `BlockLower`
    [n*M, C, C], W [n, M, C, K] and U [n, M, C, V] as the forward kept them; dS [M, K, V] w.r.t. the state
    after the slab.

    Returns ((dq, dk, dv, dbeta, dG) in the inputs' layouts, dG None without a gate; dS w.r.t. the state
    before the slab)."""
    n, M, C, K = q.shape
    V = v.shape[-1]
    P = n * M
    flat = lambda x: x.reshape(P, *x.shape[2:])  # noqa: E731
    # do may come in with zero strides (the gradient of a sum), which batched matmuls handle one by one
    q, k, v, beta, do = flat(q), flat(k), flat(v), flat(beta), flat(do).contiguous()

    s = A_qk.diag.shape[-1]
    # the decayed rows
    Gamma, to_end = gate.start_factor(), gate.end_factor()  # exp(G), exp(G_C - G); None without a gate
    decayed = lambda x, f: x if f is None else x * f  # noqa: E731
    q_start, k_end = decayed(q, Gamma), decayed(k, to_end)
    decay_end = None if gate.decay_end is None else gate.decay_end.view(n, M, -1)
    S_in = states.view(P, K, V)
    W, U = W.view(P, C, K), U.view(P, C, V)

    # 1. the scan in reverse (every product with do carries the output's scale)
    do = do * scale
    dU = A_qk.t_matmul(do)[0]
    dS_direct = q_start.transpose(-1, -2) @ do
    dU, dS_next, dS = state_scan_backward(
        dU.view(n, M, C, V), dS_direct.view(n, M, K, V), W.view(n, M, C, K), k_end.view(n, M, C, K), decay_end, dS
    )
    dU, dS_next = dU.view(P, C, V), dS_next.view(P, K, V)

    # 2. chunk-local products
    S_in_T = S_in.transpose(-1, -2)
    dq_start = do @ S_in_T
    dA_qk = BlockLower.outer(do, U, s)
    dk_end = U @ dS_next.transpose(-1, -2)

    # 3. the UT transform: dX_v = T^T dU; the gradient w.r.t. X_k = beta k * Gamma is -dX_v S^T, and
    # dL = -dX_v U^T (strictly lower). Both signs are carried by -beta below, never by a pass of their own.
    dX_v = T.t_matmul(dU)[0]
    dX_k = dX_v @ S_in_T  # the gradient w.r.t. X_k, negated
    minus_dL = BlockLower.outer(dX_v, U, s, strict=True)
    dv = beta * dX_v
    minus_beta = -beta

    # 4. the gated scores A_qk = q | k and L = (beta k) | k, then the decayed rows:
    # row terms (k as L's rows, k * Gamma) enter dG with +, column terms (k as columns, k_end) with -
    dq, minus_dx_row = gate.lower([dA_qk, minus_dL], k)
    columns = gate.upper_sum((dA_qk, q), (minus_dL, minus_beta * k))
    if Gamma is None:
        dq += dq_start
        minus_rows = minus_dx_row.add_(dX_k)  # minus the gradient w.r.t. beta k, through L's rows and X_k
        columns += dk_end
    else:
        dq.addcmul_(Gamma, dq_start)
        minus_rows = minus_dx_row.addcmul_(Gamma, dX_k)
        columns.addcmul_(to_end, dk_end)
    dbeta = (dX_v * v).sum(-1, keepdim=True) - (k * minus_rows).sum(-1, keepdim=True)
    rows_k = minus_rows.mul_(minus_beta)
    dk = rows_k + columns
    if G is None:
        dG = None
    else:
        dG = torch.sub(rows_k, columns).mul_(k).addcmul_(q, dq)
        # the chunk's last gate G_C also reaches every k_end row and exp(G_C)
        dG[:, -1] += (k_end * dk_end).sum(-2) + (S_in * dS_next).sum(-1) * gate.decay_end
        dG = gate.channel_sum(dG).view(n, M, C, -1)
    shaped = lambda x, d: x.view(n, M, C, d)  # noqa: E731
    return (shaped(dq, K), shaped(dk, K), shaped(dv, V), shaped(dbeta, 1), dG), dS
