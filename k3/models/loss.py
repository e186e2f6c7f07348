"""The language-model loss without the whole logits: the LM head and the cross-entropy in pieces of tokens.

    loss = mean_n [ logsumexp(h_n W^T) - (h_n W^T)[y_n] ]        h [N, d] final hidden states, W [V, d] the head

`head_cross_entropy` never holds the [N, V] logits, their log-softmax or its gradient whole, only one
piece's [tokens, V] float32 block at a time, and exponentiates the softmax once per token instead of
twice (forward and backward). With gradients the gradient is formed in the same pass as the loss: the
loss is the last op of the graph, so its backward only scales what the forward prepared.

`CausalLM.forward(input_ids, targets=...)` returns this loss (the nanoGPT convention of passing the
targets to the model), so that every way of running a model (alone, under DDP, sharded by FSDP) computes
it the same way.
"""

from __future__ import annotations

import torch

from ..layers.norm import upcast
from ..ops.common import autocast_dtype, without_autocast

IGNORE_INDEX = -100  # a target that does not count (F.cross_entropy's default ignore_index)

# logits per piece of the head: 2^21 float32 values, an 8 MB block (512 tokens at vocabulary 4096)
HEAD_PIECE = 1 << 21


class _HeadCrossEntropy(torch.autograd.Function):
    """loss = Σ_n c_n [logsumexp(h_n W^T) − (h_n W^T)[y_n]] over pieces of tokens, c_n [N] each token's
    weight (the reduction's scale where it counts, 0 where its target is IGNORE_INDEX).

    Per piece: logits = h W^T, e = exp(logits − max), lse = max + log Σ e; with gradients,
    dlogits = c · (softmax − onehot(y)), dh = dlogits W and dW += dlogits^T h, formed here and
    scaled by the incoming gradient in backward (which saves no [tokens, vocab] tensor)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, tokens_per_piece: int, scale: torch.Tensor, with_grad: bool):
        # the three matmuls run in the sums' dtype `acc` (float32; float64 for float64), or under autocast
        # (k3 train --precision bf16) in its dtype, as F.linear's would, with float32 sums
        low = autocast_dtype(hidden)
        acc = upcast(hidden).dtype if low is None else torch.float32
        low = low or acc
        h_all, w = hidden.to(low), weight.to(low)  # [N, d], [V, d]
        total = torch.zeros((), dtype=acc, device=hidden.device)
        want_h = with_grad and ctx.needs_input_grad[0]
        want_w = with_grad and ctx.needs_input_grad[1]
        dh = torch.empty(h_all.shape, dtype=acc, device=hidden.device) if want_h else None
        dw = torch.zeros(w.shape, dtype=acc, device=w.device) if want_w else None
        with without_autocast(h_all):
            for start in range(0, h_all.shape[0], tokens_per_piece):
                h, y = h_all[start : start + tokens_per_piece], targets[start : start + tokens_per_piece, None]
                c = scale[start : start + tokens_per_piece, None].to(acc)  # [n, 1]
                logits = (h @ w.t()).to(acc)  # [n, V]
                picked = logits.gather(1, y)  # the target's logit, [n, 1]
                top = logits.amax(1, keepdim=True)
                e = logits.sub_(top).exp_()  # in place: the piece's only [n, V] block
                sums = e.sum(1, keepdim=True)
                total += ((top + sums.log() - picked) * c).sum()
                if want_h or want_w:
                    grad = e.mul_(c / sums)  # c · softmax
                    grad.scatter_add_(1, y, -c)  # − c · onehot
                    _accumulate(grad.to(low), h, w, dh, dw, start)
        ctx.save_for_backward(dh, dw)
        ctx.dtypes = hidden.dtype, weight.dtype
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        dh, dw = ctx.saved_tensors
        if (ctx.needs_input_grad[0] and dh is None) or (ctx.needs_input_grad[1] and dw is None):
            raise RuntimeError(
                "head_cross_entropy: the gradient is formed in the forward pass; run it with "
                "gradients enabled to differentiate it"
            )
        grad_h = None if dh is None else (dh * grad_loss).to(ctx.dtypes[0])
        grad_w = None if dw is None else (dw * grad_loss).to(ctx.dtypes[1])
        return grad_h, grad_w, None, None, None, None


def _accumulate(
    grad: torch.Tensor, h: torch.Tensor, w: torch.Tensor, dh: torch.Tensor | None, dw: torch.Tensor | None, start: int
) -> None:
    """dh[piece] = grad W and dW += grad^T h for one piece; in place when the matmuls run in the sums'
    dtype, else (autocast's bf16 products) added in float32."""
    n = grad.shape[0]
    same = grad.dtype == (dh if dh is not None else dw).dtype
    if dh is not None:
        if same:
            torch.mm(grad, w, out=dh[start : start + n])
        else:
            dh[start : start + n] = grad @ w
    if dw is not None:
        if same:
            dw.addmm_(grad.t(), h)
        else:
            dw += grad.t() @ h


def head_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reduction: str = "mean", piece: int = HEAD_PIECE
) -> torch.Tensor:
    """Cross-entropy of the logits hidden @ weight^T against `targets`, without forming them whole.

    hidden [N, d], weight [V, d] (the LM head's, or the tied embedding), targets [N] token ids, where
    IGNORE_INDEX (-100, PyTorch's and transformers' convention) marks a token that does not count;
    `reduction` "mean" (over the counted tokens) or "sum". Computed in float32 (float64 for float64 inputs),
    `piece` logits at a time (whole tokens, at least one); equals F.cross_entropy(hidden @ weight^T, targets)
    to rounding.
    With gradients enabled the gradient is formed during this call (see `_HeadCrossEntropy`)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"head_cross_entropy: `reduction` must be 'mean' or 'sum', got {reduction!r}")
    targets = targets.reshape(-1)
    if hidden.dim() != 2 or hidden.shape[0] != targets.numel():
        raise ValueError(
            f"head_cross_entropy: `hidden` must be [N, d] with N = {targets.numel()} (the targets), "
            f"got {list(hidden.shape)}"
        )
    # every token goes through the head (no data-dependent selection: nothing is read back to the host);
    # an ignored one's weight is 0, and its target a valid index that it never counts for
    counted = targets != IGNORE_INDEX
    scale = counted.to(upcast(hidden).dtype)
    if reduction == "mean":
        scale = scale / counted.sum().clamp(min=1)
    targets = targets.clamp(min=0)
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    tokens = max(1, piece // weight.shape[0])
    return _HeadCrossEntropy.apply(hidden, weight, targets, tokens, scale, with_grad)
