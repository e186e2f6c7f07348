"""The only sequential part of the chunkwise delta rule: the state carried from chunk to chunk.

For chunks i = 0, 1, ... in order, with W_i, U0_i from the UT transform (`k3.ops.ut`), K_end_i the keys
decayed to the chunk end and decay_end_i = exp(G_C) of chunk i:

    U_i = U0_i - W_i S_i,     S_{i+1} = Diag(decay_end_i) S_i + K_end_i^T U_i

and, in the backward, the same chain in reverse (`state_scan_backward`).
"""

from __future__ import annotations

import torch


def state_scan(W, U0, K_end, decay_end, S0, buffer=None):
    """The only sequential part: for each chunk i (in order),
        U_i = U0_i - W_i S_i,     S_{i+1} = Diag(decay_end_i) S_i + K_end_i^T U_i.
    W, K_end [n, M, C, K]; U0 [n, M, C, V]; decay_end None | [n, M, K|1]; S0 [M, K, V].
    Returns U [n, M, C, V] and the states S_0..S_n stacked [n+1, M, K, V] (in `buffer` when given and
    no gradient is needed)."""
    n = W.shape[0]
    K_end_T = K_end.transpose(-1, -2)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (W, U0, K_end, decay_end, S0)
    )
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


def state_scan_backward(dU, dS_from_output, W, K_end, decay_end, dS):
    """The scan's gradient, chunk by chunk in reverse. With dS the gradient w.r.t. S_{i+1}:

        dU_i = dU_i(direct) + K_end_i dS,      dS_i = Diag(decay_end_i) dS + dS_i(direct) - W_i^T dU_i

    dU [n, M, C, V] the gradient reaching U from the outputs (updated in place into the whole dU);
    dS_from_output [n, M, K, V] the gradient reaching each chunk's incoming state from its outputs;
    W, K_end [n, M, C, K]; decay_end None | [n, M, K|1]; dS [M, K, V] w.r.t. the state after the last
    chunk. Returns (dU, dS_next [n, M, K, V] the gradient w.r.t. each chunk's outgoing state, dS_0)."""
    n = W.shape[0]
    dS_next = dU.new_empty(n, *dS.shape)
    dS_next[-1] = dS
    # every chunk's slices taken once (unbind), not by indexing in the loop
    decays = (None,) * n if decay_end is None else decay_end.unsqueeze(-1).unbind(0)
    grads_after, dU_all = dS_next.unbind(0), dU.unbind(0)
    W_T, K_end_all, direct = W.transpose(-1, -2).unbind(0), K_end.unbind(0), dS_from_output.unbind(0)
    for i in reversed(range(n)):
        after = grads_after[i]
        dU_all[i].baddbmm_(K_end_all[i], after)
        # dS_i, written where chunk i - 1 reads it as the gradient of its outgoing state
        before = torch.baddbmm(direct[i], W_T[i], dU_all[i], alpha=-1.0, out=grads_after[i - 1] if i else None)
        if decays[i] is None:
            before += after
        else:
            before.addcmul_(after, decays[i])
    return dU, dS_next, before
