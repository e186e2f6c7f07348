"""Feed-forward blocks of the lineage.

- GPT-2:  y = c_proj(GELU(c_fc(x))), hidden 4d, with biases (tanh-approximated GELU, as GPT-2 has it).
- SwiGLU: y = down(SiLU(gate(x)) * up(x)) (LLaMA, Kimi Linear's dense layer and experts).
- SiTU-GLU (Kimi K3): y = down(a * u) with

      a = beta * tanh(gate / beta) * sigmoid(gate)          (SiTU: SiLU with its linear growth capped at beta)
      u = l_beta * tanh(up / l_beta)                        (only when l_beta is set: a soft clip of up)

  computed in float32. As beta -> inf, beta * tanh(gate / beta) -> gate and SiTU -> SiLU, so SiTU-GLU
  becomes SwiGLU. Kimi K3 uses beta = 4, l_beta = 25 everywhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .init import init_linear
from .norm import upcast


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float | None = 25.0
         ) -> torch.Tensor:
    """SiTU-GLU activation a(gate) * u(up), computed in float32 (float64 for float64 inputs) and
    returned in gate's dtype."""
    if beta <= 0:
        raise ValueError(f"situ: `beta` must be > 0, got {beta}")
    if linear_beta is not None and linear_beta <= 0:
        raise ValueError(f"situ: `linear_beta` must be > 0 or None, got {linear_beta}")
    g, u = upcast(gate), upcast(up)
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (a * u).to(gate.dtype)


class GeluMLP(nn.Module):
    """GPT-2's MLP: c_fc (d -> hidden, bias), tanh-GELU, c_proj (hidden -> d, bias)."""

    def __init__(self, dim: int, hidden: int | None = None):
        super().__init__()
        hidden = 4 * dim if hidden is None else hidden
        self.c_fc = nn.Linear(dim, hidden)
        self.c_proj = nn.Linear(hidden, dim)
        self.reset_parameters()

    def reset_parameters(self, std: float | None = None, residual_std: float | None = None) -> None:
        """See k3.layers.init: c_fc ~ N(0, std), the output c_proj ~ N(0, residual_std), biases 0."""
        init_linear(self.c_fc, std)
        init_linear(self.c_proj, std if residual_std is None else residual_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., dim]
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GatedMLP(nn.Module):
    """Gated FFN y = down_proj(act(gate_proj(x), up_proj(x))), no biases (Kimi Linear / K3 naming).

    activation: "swiglu" (SiLU(gate) * up) or "situ" (see `situ`, with `situ_beta`, `situ_linear_beta`).
    """

    def __init__(self, dim: int, hidden: int, activation: str = "swiglu", situ_beta: float = 4.0,
                 situ_linear_beta: float | None = 25.0):
        super().__init__()
        if activation not in ("swiglu", "situ"):
            raise ValueError(f"GatedMLP: `activation` must be 'swiglu' or 'situ', got {activation!r}")
        self.activation = activation
        self.situ_beta, self.situ_linear_beta = situ_beta, situ_linear_beta
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.reset_parameters()

    def reset_parameters(self, std: float | None = None, residual_std: float | None = None) -> None:
        """See k3.layers.init: gate and up ~ N(0, std), the output down_proj ~ N(0, residual_std)."""
        init_linear(self.gate_proj, std)
        init_linear(self.up_proj, std)
        init_linear(self.down_proj, std if residual_std is None else residual_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., dim]
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.activation == "situ":
            hidden = situ(gate, up, self.situ_beta, self.situ_linear_beta)
        else:
            hidden = F.silu(gate) * up
        return self.down_proj(hidden)

    def extra_repr(self) -> str:
        if self.activation == "situ":
            return f"activation=situ, beta={self.situ_beta}, linear_beta={self.situ_linear_beta}"
        return "activation=swiglu"
