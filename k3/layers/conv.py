"""ShortConvolution: the depthwise causal convolution DeltaNet, Gated DeltaNet and KDA put in front of
q, k and v (kernel 4, no bias), followed by SiLU.

    y_t = SiLU( sum_{j=0}^{W-1} w_j * x_{t-W+1+j} )        per channel; x_t = 0 before the sequence

For decoding, the last W-1 inputs are the convolution state [N, D, W-1]: feeding a sequence in pieces
through the returned state gives the one-call result. One token from a state (`step`) is a rolling
window rather than a convolution: y = SiLU(sum_j w_j [state, x]_j), and the new state is the window
without its oldest input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.common import cast
from . import init


class ShortConvolution(nn.Module):
    """Depthwise causal conv1d over time. weight [D, 1, W] (the nn.Conv1d layout, so checkpoints map 1:1)."""

    def __init__(self, dim: int, kernel_size: int = 4, activation: str | None = "silu"):
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"ShortConvolution: `kernel_size` must be >= 1, got {kernel_size}")
        if activation not in (None, "silu"):
            raise ValueError(f"ShortConvolution: `activation` must be 'silu' or None, got {activation!r}")
        self.dim, self.kernel_size, self.activation = dim, kernel_size, activation
        self.weight = nn.Parameter(torch.empty(dim, 1, kernel_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init.kaiming_uniform_fan_in_(self.weight)  # nn.Conv1d's default (as fla and Kimi Linear keep it)

    def forward(
        self, x: torch.Tensor, conv_state: torch.Tensor | None = None, output_final_state: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [B, T, D]; conv_state [B, D, W-1] (the previous W-1 inputs) or None (zeros).
        Returns (y [B, T, D], new conv_state [B, D, W-1] or None)."""
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"ShortConvolution: `x` must be [B, T, {self.dim}], got {list(x.shape)}")
        B, T, D = x.shape
        W = self.kernel_size
        if conv_state is not None and tuple(conv_state.shape) != (B, D, W - 1):
            raise ValueError(
                f"ShortConvolution: `conv_state` must be [{B}, {D}, {W - 1}] "
                f"(batch, channels, kernel_size - 1), got {list(conv_state.shape)}"
            )
        if T == 1 and conv_state is not None:
            y, state = self.step(x[:, 0], conv_state)
            return y.unsqueeze(1), (state if output_final_state else None)
        if conv_state is None and not output_final_state and T > 0:
            return _ShortConv.apply(x, cast(self.weight, x.dtype), self.activation == "silu", True), None
        history = x.new_zeros(B, W - 1, D) if conv_state is None else cast(conv_state, x.dtype).transpose(1, 2)
        if T == 0:
            return x, (history.transpose(1, 2).clone() if output_final_state else None)
        padded = torch.cat([history, x], dim=1)  # [B, W-1+T, D]: the inputs each output reads, time-major
        y = _ShortConv.apply(padded, cast(self.weight, x.dtype), self.activation == "silu", False)
        new_state = padded[:, T:].transpose(1, 2).clone() if output_final_state else None
        return y, new_state

    def step(self, x: torch.Tensor, conv_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token after `conv_state`: x [B, D], conv_state [B, D, W-1] -> (y [B, D], new state
        [B, D, W-1]); see `rolling_step`."""
        return rolling_step(x, conv_state, self.weight, self.activation)

    def extra_repr(self) -> str:
        return f"{self.dim}, kernel_size={self.kernel_size}, activation={self.activation}"


class _ShortConv(torch.autograd.Function):
    """The convolution of a padded sequence p [B, W-1+T, D] (its first W-1 steps the history) as W shifted
    multiply-adds in the [B, T, D] layout the layers use, then SiLU:

        pre_t = sum_j w_j p_{t+j},   y = SiLU(pre)
        backward, with G = dL/dy and P = G SiLU'(pre):   dp_{t+j} += w_j P_t,   dw_j = sum_{b,t} p_{t+j} P_t

    With `zero_history` the input is x [B, T, D] itself and the history zeros (a sequence from its start,
    as training runs it): tap j reads x shifted by W-1-j, and nothing is padded, copied or zeroed.
    conv1d over [B, D, T] needs the sequence transposed in and out, and its backward with SiLU's on the
    transposed layout costs several times these few passes on CPU. Saves the input and pre."""

    @staticmethod
    def forward(ctx, padded: torch.Tensor, weight: torch.Tensor, silu: bool, zero_history: bool) -> torch.Tensor:
        W = weight.shape[-1]
        taps = weight.view(-1, W)  # [D, W]
        if zero_history:
            T = padded.shape[1]
            pre = padded * taps[:, W - 1]
            for j in range(max(0, W - T), W - 1):  # the taps whose shift W-1-j is < T
                shift = W - 1 - j
                pre[:, shift:].addcmul_(padded[:, : T - shift], taps[:, j])
        else:
            T = padded.shape[1] - (W - 1)
            pre = padded[:, W - 1 :] * taps[:, W - 1]
            for j in range(W - 1):
                pre.addcmul_(padded[:, j : j + T], taps[:, j])
        ctx.save_for_backward(padded, weight, pre)
        ctx.silu, ctx.zero_history = silu, zero_history
        return F.silu(pre) if silu else pre.clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        padded, weight, pre = ctx.saved_tensors
        W = weight.shape[-1]
        T = pre.shape[1]
        taps = weight.view(-1, W)
        P = torch.ops.aten.silu_backward(grad.contiguous(), pre) if ctx.silu else grad
        grad_padded = grad_weight = None
        if ctx.zero_history:
            shifts = [(j, W - 1 - j) for j in range(W) if W - 1 - j < T]  # tap j, the shift it reads at
            if ctx.needs_input_grad[0]:
                grad_padded = P * taps[:, W - 1]
                for j, shift in shifts[:-1]:
                    grad_padded[:, : T - shift].addcmul_(P[:, shift:], taps[:, j])
            if ctx.needs_input_grad[1]:
                grad_weight = padded.new_zeros(taps.shape)
                for j, shift in shifts:
                    grad_weight[:, j] = torch.linalg.vecdot(padded[:, : T - shift], P[:, shift:], dim=1).sum(0)
                grad_weight = grad_weight.view(weight.shape)
            return grad_padded, grad_weight, None, None
        if ctx.needs_input_grad[0]:
            grad_padded = padded.new_zeros(padded.shape)
            for j in range(W):
                grad_padded[:, j : j + T].addcmul_(P, taps[:, j])
        if ctx.needs_input_grad[1]:
            grad_weight = torch.stack(
                [torch.linalg.vecdot(padded[:, j : j + T], P, dim=1).sum(0) for j in range(W)], dim=-1
            ).view(weight.shape)
        return grad_padded, grad_weight, None, None


def rolling_step(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, activation: str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The convolution at one new position, as a rolling window: x [B, D], conv_state [B, D, W-1],
    weight [D, 1, W] -> (y [B, D], new state [B, D, W-1]).

        window = [conv_state, x]   [B, D, W];   y = SiLU( sum_j w_j window_j );   new state = window[..., 1:]

    A few elementwise ops instead of a conv1d call. The new state is a view of the window, which
    nothing else holds: no copy. Unchecked (the decode steps of the layers call it with the state they
    keep)."""
    window = torch.cat([cast(conv_state, x.dtype), x.unsqueeze(-1)], dim=-1)
    y = (window * cast(weight, x.dtype).squeeze(1)).sum(-1)
    if activation == "silu":
        y = F.silu(y)
    return y, window[..., 1:]


def joint_step(
    convs: list[ShortConvolution], xs: list[torch.Tensor], states: list[torch.Tensor]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`step` of several convolutions (same kernel size and activation) on one token, as one rolling
    window over their channels side by side: xs [B, D_i], states [B, D_i, W-1] -> (y [B, sum D_i], the
    new states [B, D_i, W-1]). See `joint_window_step`, which takes and gives the states joined."""
    y, window = joint_window_step(convs, xs, torch.cat(states, dim=1))
    return y, list(window.split([conv.dim for conv in convs], dim=1))


def joint_window_step(
    convs: list[ShortConvolution], xs: list[torch.Tensor], window: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`joint_step` with the states joined along the channels: window [B, sum D_i, W-1] -> (y [B, sum D_i],
    the new window [B, sum D_i, W-1]). What the linear family's decode step runs for its q, k and v (a
    static cache keeps the three states as one such window)."""
    return rolling_step(torch.cat(xs, dim=-1), window, torch.cat([conv.weight for conv in convs]), convs[0].activation)
