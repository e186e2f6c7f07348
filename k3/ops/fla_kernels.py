"""flash-linear-attention's (fla) kernels for the delta family, as PyTorch custom ops.

Each fla call is a `torch.library.custom_op` with a fake (shape-only) implementation and, for the chunk
forms, a registered backward: `torch.compile` sees one opaque call it can trace with `fullgraph=True`
(fla's own entry points are `@torch.compiler.disable`, a graph break each), and a CUDA graph can capture
it. The same signature covers the whole family, as the recurrence is one (`k3.ops.delta_family`):

    S' = Diag(exp g_t) S_{t-1};  S_t = S' + beta_t k_t^T (v_t - k_t S');  o_t = scale q_t S_t

with `gate` "none" (DeltaNet: no g), "head" (Gated DeltaNet: g [B,T,H]) or "channel" (KDA: g [B,T,H,K]).
fla's g is the same natural-log decay as k3's (its kernels rescale it to base 2 themselves).

The chunk forward returns what fla's backward reads besides the inputs (the chunks' cumulative gates and
their intra-chunk matrices), so the backward runs fla's backward kernels without recomputing the forward,
as fla's own autograd functions do. fla is imported inside the implementations: k3 imports without it.
Arguments arrive validated and prepared by `k3.ops.delta_family.run_delta_op`; k3 never calls these
directly (`k3.ops.kernels` decides when fla runs).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def _chunk_indices(cu_seqlens: Tensor | None, chunk_size: int) -> Tensor | None:
    if cu_seqlens is None:
        return None
    from fla.ops.utils import prepare_chunk_indices

    return prepare_chunk_indices(cu_seqlens, chunk_size)


def _num_states(q: Tensor, cu_seqlens: Tensor | None) -> int:
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _safe_gate(lower_bound: float | None) -> bool:
    """fla's `safe_gate` path assumes every step's g >= lower_bound >= -5 (Kimi K3's safe gate)."""
    return lower_bound is not None and -5.0 <= lower_bound < 0.0


def _empty(q: Tensor) -> Tensor:
    """The placeholder for a tensor a case does not have (custom ops return tensors, never None)."""
    return q.new_empty(0)


# ---------------------------------------------------------------- the chunk forms: forward


@torch.library.custom_op("k3::fla_chunk_delta", mutates_args=())
def fla_chunk_delta(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Optional[Tensor],
    beta: Tensor,
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    gate: str,
    scale: float,
    chunk_size: int,
    lower_bound: Optional[float],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """fla's chunk kernel: (o [B,T,H,V], final state [N,H,K,V] float32, then what the backward reads:
    the cumulative gate (empty without g), the intra-chunk matrix A, and KDA's second one (else empty))."""
    q, k, v, beta = (x.contiguous() for x in (q, k, v, beta))
    g = None if g is None else g.contiguous()
    indices = _chunk_indices(cu_seqlens, chunk_size)
    common = dict(
        q=q, k=k, v=v, beta=beta, scale=scale, initial_state=initial_state, output_final_state=True,
        cu_seqlens=cu_seqlens, chunk_indices=indices, chunk_size=chunk_size,
    )  # fmt: skip
    if gate == "channel":
        from fla.ops.kda.chunk_fwd import chunk_kda_fwd

        o, ht, g_cumsum, A, A2, *_ = chunk_kda_fwd(
            g=g, safe_gate=_safe_gate(lower_bound), lower_bound=lower_bound, **common
        )
    elif gate == "head":
        from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd

        g_cumsum, o, A, ht, *_ = chunk_gated_delta_rule_fwd(g=g, **common)
        A2 = _empty(q)
    else:
        from fla.ops.delta_rule.chunk import chunk_delta_rule_fwd

        o, A, ht = chunk_delta_rule_fwd(**common)
        g_cumsum, A2 = _empty(q), _empty(q)
    return o.to(v.dtype), ht, g_cumsum, A, A2


@fla_chunk_delta.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, gate, scale, chunk_size, lower_bound):
    B, T, H, K = q.shape
    o = v.new_empty(v.shape)
    ht = q.new_empty(_num_states(q, cu_seqlens), H, K, v.shape[-1], dtype=torch.float32)
    A = q.new_empty(B, T, H, chunk_size)
    if gate == "channel":
        return o, ht, q.new_empty(B, T, H, K, dtype=torch.float32), A, q.new_empty(B, T, H, chunk_size)
    if gate == "head":
        return o, ht, q.new_empty(B, T, H, dtype=torch.float32), A, _empty(q)
    return o, ht, _empty(q), A, _empty(q)


# ---------------------------------------------------------------- the chunk forms: backward


@torch.library.custom_op("k3::fla_chunk_delta_backward", mutates_args=())
def fla_chunk_delta_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    g_cumsum: Tensor,
    A: Tensor,
    A2: Tensor,
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    do: Tensor,
    dht: Tensor,
    gate: str,
    scale: float,
    chunk_size: int,
    lower_bound: Optional[float],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """fla's backward kernels: (dq, dk, dv, dg (empty without g), dbeta, dh0 (empty without h0))."""
    q, k, v, beta, do, dht = (x.contiguous() for x in (q, k, v, beta, do, dht))
    common = dict(
        q=q, k=k, v=v, beta=beta, scale=scale, initial_state=initial_state, do=do, dht=dht,
        cu_seqlens=cu_seqlens, chunk_indices=_chunk_indices(cu_seqlens, chunk_size), chunk_size=chunk_size,
    )  # fmt: skip
    if gate == "channel":
        from fla.ops.kda.chunk_bwd import chunk_kda_bwd

        dq, dk, dv, db, dg, dh0, *_ = chunk_kda_bwd(
            Aqk=A, Akk=A2, g=g_cumsum, safe_gate=_safe_gate(lower_bound), lower_bound=lower_bound, **common
        )
    elif gate == "head":
        from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd

        dq, dk, dv, db, dg, dh0, *_ = chunk_gated_delta_rule_bwd(g=g_cumsum, A=A, **common)
    else:
        from fla.ops.delta_rule.chunk import chunk_delta_rule_bwd

        dq, dk, dv, db, dh0 = chunk_delta_rule_bwd(A=A, **common)
        dg = None
    dg = _empty(q) if dg is None else dg.to(g_cumsum.dtype)
    dh0 = _empty(q) if initial_state is None else dh0
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg, db.to(beta.dtype), dh0


@fla_chunk_delta_backward.register_fake
def _(q, k, v, beta, g_cumsum, A, A2, initial_state, cu_seqlens, do, dht, gate, scale, chunk_size, lower_bound):
    dg = _empty(q) if gate == "none" else g_cumsum.new_empty(g_cumsum.shape)
    dh0 = _empty(q) if initial_state is None else initial_state.new_empty(initial_state.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dg, beta.new_empty(beta.shape), dh0


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, initial_state, cu_seqlens, gate, scale, chunk_size, lower_bound = inputs
    _, _, g_cumsum, A, A2 = output
    ctx.save_for_backward(q, k, v, beta, g_cumsum, A, A2, initial_state, cu_seqlens)
    ctx.options = (gate, scale, chunk_size, lower_bound)
    ctx.g_dtype = None if g is None else g.dtype


def _backward(ctx, do, dht, *_residual_grads):
    q, k, v, beta, g_cumsum, A, A2, initial_state, cu_seqlens = ctx.saved_tensors
    dq, dk, dv, dg, db, dh0 = torch.ops.k3.fla_chunk_delta_backward(
        q, k, v, beta, g_cumsum, A, A2, initial_state, cu_seqlens, do, dht, *ctx.options
    )
    dg = None if ctx.g_dtype is None else dg.to(ctx.g_dtype)
    dh0 = None if initial_state is None else dh0
    return dq, dk, dv, dg, db, dh0, None, None, None, None, None


torch.library.register_autograd("k3::fla_chunk_delta", _backward, setup_context=_setup_context)


# ---------------------------------------------------------------- the recurrent forms (decoding)


@torch.library.custom_op("k3::fla_recurrent_delta", mutates_args=())
def fla_recurrent_delta(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Optional[Tensor],
    beta: Tensor,
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    gate: str,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """fla's fused recurrent kernel, token by token in one launch: (o [B,T,H,V], final state [N,H,K,V]
    float32). Forward only: k3 runs it where no gradient is taken (decoding)."""
    common = dict(scale=scale, initial_state=initial_state, output_final_state=True, cu_seqlens=cu_seqlens)
    with torch.no_grad():
        if gate == "channel":
            from fla.ops.kda import fused_recurrent_kda

            o, ht = fused_recurrent_kda(q, k, v, g, beta, **common)
        elif gate == "head":
            from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

            o, ht = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, **common)
        else:
            from fla.ops.delta_rule import fused_recurrent_delta_rule

            o, ht = fused_recurrent_delta_rule(q, k, v, beta=beta, **common)
    return o.to(v.dtype), ht


@fla_recurrent_delta.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, gate, scale):
    H, K = q.shape[2:]
    return v.new_empty(v.shape), q.new_empty(_num_states(q, cu_seqlens), H, K, v.shape[-1], dtype=torch.float32)
