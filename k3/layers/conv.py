"""ShortConvolution: the depthwise causal convolution DeltaNet, Gated DeltaNet and KDA put in front of
q, k and v (kernel 4, no bias), followed by SiLU.

    y_t = SiLU( sum_{j=0}^{W-1} w_j * x_{t-W+1+j} )        per channel; x_t = 0 before the sequence

For decoding, the last W-1 inputs are the convolution state [N, D, W-1]: feeding a sequence in pieces
through the returned state gives exactly the one-call result.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)  # nn.Conv1d's default (as fla and Kimi Linear keep it)

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor | None = None,
                output_final_state: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [B, T, D]; conv_state [B, D, W-1] (the previous W-1 inputs) or None (zeros).
        Returns (y [B, T, D], new conv_state [B, D, W-1] or None)."""
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"ShortConvolution: `x` must be [B, T, {self.dim}], got {list(x.shape)}")
        B, T, D = x.shape
        W = self.kernel_size
        xt = x.transpose(1, 2)  # [B, D, T]
        if conv_state is None:
            history = xt.new_zeros(B, D, W - 1)
        else:
            if tuple(conv_state.shape) != (B, D, W - 1):
                raise ValueError(f"ShortConvolution: `conv_state` must be [{B}, {D}, {W - 1}] "
                                 f"(batch, channels, kernel_size - 1), got {list(conv_state.shape)}")
            history = conv_state.to(xt.dtype)
        if T == 0:
            return x, (history.clone() if output_final_state else None)
        xt = torch.cat([history, xt], dim=-1)  # [B, D, W-1+T]
        y = F.conv1d(xt, self.weight.to(xt.dtype), groups=D)  # [B, D, T]
        if self.activation == "silu":
            y = F.silu(y)
        new_state = xt[..., xt.shape[-1] - (W - 1):].clone() if output_final_state else None
        return y.transpose(1, 2), new_state

    def extra_repr(self) -> str:
        return f"{self.dim}, kernel_size={self.kernel_size}, activation={self.activation}"
