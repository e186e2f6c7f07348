"""The largest pre-softmax logit of each attention head: what QK-Clip (k3.training.qk_clip) bounds.

    S_max^h = max over the rows b, the queries i and the keys j that query i sees of  scale * q_i^h . k_j^h

The attention itself runs in a fused kernel that never shows its scores, so the maximum is computed
apart, under no_grad, in float32 (float64 for float64 inputs) and outside autocast: the scores of a
block of queries at a time against the keys the block sees (at most QUERY_BLOCK queries and MAX_SCORES
values, whatever the sequence length), masked causally.

A layer records it only while the trainer asks (`record_max_logits` set on the layer by
k3.training.qk_clip) and only in a training forward (`module.training` and gradients on): evaluation,
generation and any forward under no_grad pay nothing. Each recording takes the maximum with the one
before (`module.max_logits` [H]), so the micro-batches of a step, or a layer's forward run again by
activation recompute, give the step's maximum; the trainer clears it when a step begins.
"""

from __future__ import annotations

import torch

from ..ops.common import cast, compute_dtype

MAX_SCORES = 2**22  # scores of one block of queries (16 MiB in float32): the computation's memory bound
QUERY_BLOCK = 64  # the most queries a block: a block of early queries multiplies only the keys they see, so the
# causal triangle costs about half the products of the whole square (62% at T = 256, 53% at T = 2048)


def causal_max_logits(
    q: torch.Tensor, k: torch.Tensor, scale: float, start: torch.Tensor | None = None
) -> torch.Tensor:
    """q [B, T, H, K] (the last T slots of the sequence), k [B, S, H, K] -> S_max [H]: each head's largest
    scale * q_i . k_j over the slots j <= S - T + i that query i sees (and j >= start[b], a row's empty
    leading slots, with `start` [B]), as k3.ops.attention.causal_attention masks them."""
    B, T, H, _ = q.shape
    S = k.shape[1]
    dtype = compute_dtype(q.dtype)
    best = torch.full((H,), float("-inf"), dtype=dtype, device=q.device)
    block = max(1, min(QUERY_BLOCK, MAX_SCORES // max(1, B * H * S)))
    with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
        qf, kf = cast(q, dtype), cast(k, dtype)
        for i0 in range(0, T, block):
            i1 = min(T, i0 + block)
            seen = S - T + i1  # the last query of the block sees slots < seen
            # q . k without the scale, which (> 0) multiplies the maximum instead: [B, H, i1 - i0, seen]
            scores = qf[:, i0:i1].transpose(1, 2) @ kf[:, :seen].permute(0, 2, 3, 1)
            slot = torch.arange(seen, device=q.device)
            allowed = slot <= (S - T + torch.arange(i0, i1, device=q.device))[:, None]  # [i1 - i0, seen]
            if start is not None:
                allowed = allowed & (slot >= start.to(q.device)[:, None])[:, None, None, :]  # [B, 1, i, seen]
            scores.masked_fill_(~allowed, float("-inf"))
            best = torch.maximum(best, scores.amax(dim=(0, 2, 3)))
    return best * scale


def record_max_logits(
    module, q: torch.Tensor, k: torch.Tensor, scale: float, start: torch.Tensor | None = None
) -> None:
    """Take `causal_max_logits(q, k, scale, start)` into `module.max_logits` (the maximum with what it
    holds), when the trainer asks for it (`module.record_max_logits`) in a training forward; else nothing."""
    if not (module.record_max_logits and module.training and torch.is_grad_enabled()):
        return
    found = causal_max_logits(q, k, scale, start)
    module.max_logits = found if module.max_logits is None else torch.maximum(module.max_logits, found)
