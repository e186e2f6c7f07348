"""Feed-forward blocks of the lineage.

- GPT-2:  y = c_proj(GELU(c_fc(x))), hidden 4d, with biases (tanh-approximated GELU, as GPT-2 has it).
- SwiGLU: y = down(SiLU(gate(x)) * up(x)) (LLaMA, Kimi Linear's dense layer and experts).
- SiTU-GLU (Kimi K3): y = down(a * u) with

      a = beta * tanh(gate / beta) * sigmoid(gate)          (SiTU: SiLU with its linear growth capped at beta)
      u = l_beta * tanh(up / l_beta)                        (only when l_beta is set: a soft clip of up)

  computed in float32. As beta -> inf, beta * tanh(gate / beta) -> gate and SiTU -> SiLU, so SiTU-GLU
  becomes SwiGLU. Kimi K3 uses beta = 4, l_beta = 25 everywhere.

`situ` is one autograd function (`_SiTU`) with a hand-derived backward that keeps the gate and the forward's
tanh (float32 inputs; lower-precision ones keep gate and up alone; autograd through the formula keeps every
intermediate) and works in place; `situ_reference` is the formula as written, which `situ` equals to rounding
(tests/layers/test_situ.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.common import cast
from .init import init_linear
from .norm import upcast


def _check_betas(beta: float, linear_beta: float | None) -> None:
    if beta <= 0:
        raise ValueError(f"situ: `beta` must be > 0, got {beta}")
    if linear_beta is not None and linear_beta <= 0:
        raise ValueError(f"situ: `linear_beta` must be > 0 or None, got {linear_beta}")


def situ_reference(
    gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float | None = 25.0
) -> torch.Tensor:
    """The SiTU-GLU formula as written (see the module docstring), through autograd: what `situ` equals."""
    _check_betas(beta, linear_beta)
    g, u = upcast(gate), upcast(up)
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (a * u).to(gate.dtype)


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float | None = 25.0) -> torch.Tensor:
    """SiTU-GLU activation a(gate) * u(up), computed in float32 (float64 for float64 inputs) and
    returned in gate's dtype; gradients in each input's dtype."""
    _check_betas(beta, linear_beta)
    linear_beta = None if linear_beta is None else float(linear_beta)
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SiTU.apply(gate, up, float(beta), linear_beta)
    return _situ_forward(gate, up, float(beta), linear_beta)  # nothing to save: no autograd node


def _situ_forward(
    gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None, keep: list | None = None
) -> torch.Tensor:
    """SiTU-GLU's value (see `_SiTU` for the form): beta t s u, or beta l_beta t s t_u. With `keep` a
    list, appends t (and t_u with l_beta) for the backward."""
    g, u = upcast(gate), upcast(up)
    t = (g * (1 / beta)).tanh_()
    if keep is not None:
        keep.append(t)
    out = t * torch.sigmoid(g) if keep is not None else t.mul_(torch.sigmoid(g))  # t s = a / beta
    if linear_beta is None:
        return cast(out.mul_(u).mul_(beta), gate.dtype)
    t_u = (u * (1 / linear_beta)).tanh_()
    if keep is not None:
        keep.append(t_u)
    return cast(out.mul_(t_u).mul_(beta * linear_beta), gate.dtype)


class _SiTU(torch.autograd.Function):
    """out = a(g) u(up) with t = tanh(g / beta), s = sigmoid(g), a = beta t s, and t_u = tanh(up / l_beta),
    u = l_beta t_u (u = up without l_beta). Backward, with G the incoming gradient:

        da/dg = (1 - t^2) s + beta t s (1 - s) = s (1 - t m),    m = t - beta (1 - s)
        d out/d g = G s u (1 - t m),   d out/d up = G s beta t (1 - t_u^2)   (G a without l_beta)

    tanh is the costly kernel (about 4x a sigmoid on a CPU). Inputs already in the compute dtype (float32,
    float64) keep the forward's t and t_u (or up without l_beta) beside gate: one tensor more than the
    inputs, and only s is recomputed. Lower-precision inputs keep gate and up alone, and t, t_u are
    recomputed from them: a float32 t beside a bfloat16 gate would cost twice the gate. G s is formed once
    for both gradients. torch.tanh keeps its relative accuracy near 0, where 2 sigmoid(2x) - 1 would lose it
    to cancellation (u multiplies t_u back by l_beta = 25)."""

    @staticmethod
    def forward(ctx, gate, up, beta: float, linear_beta: float | None):
        ctx.beta, ctx.linear_beta, ctx.up_dtype = beta, linear_beta, up.dtype
        ctx.kept_tanh = gate.dtype == upcast(gate).dtype and up.dtype == gate.dtype
        if not ctx.kept_tanh:
            ctx.save_for_backward(gate, up)
            return _situ_forward(gate, up, beta, linear_beta)
        kept: list = []
        out = _situ_forward(gate, up, beta, linear_beta, kept)
        ctx.save_for_backward(gate, *kept, *(() if linear_beta is not None else (up,)))
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        beta, linear_beta = ctx.beta, ctx.linear_beta
        if ctx.kept_tanh:
            gate, t, third = ctx.saved_tensors  # third: t_u with l_beta, up without
            g = upcast(gate)
        else:
            gate, up = ctx.saved_tensors
            g, third = upcast(gate), upcast(up)
            t = (g * (1 / beta)).tanh_()
            if linear_beta is not None:
                third = (third * (1 / linear_beta)).tanh_()
        s = torch.sigmoid(g)
        m = torch.add(t, s, alpha=beta).sub_(beta)  # t - beta (1 - s)
        gs = s.mul_(upcast(grad))
        if linear_beta is None:
            grad_gate = torch.addcmul(g.new_tensor(1.0), t, m, value=-1.0).mul_(gs).mul_(upcast(third))
            grad_up = gs.mul_(t).mul_(beta)
        else:
            t_u = third
            grad_gate = torch.addcmul(g.new_tensor(linear_beta), t, m, value=-linear_beta).mul_(gs).mul_(t_u)
            grad_up = torch.addcmul(g.new_tensor(beta), t_u, t_u, value=-beta).mul_(gs).mul_(t)
        return grad_gate.to(gate.dtype), grad_up.to(ctx.up_dtype), None, None


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

    def __init__(
        self,
        dim: int,
        hidden: int,
        activation: str = "swiglu",
        situ_beta: float = 4.0,
        situ_linear_beta: float | None = 25.0,
    ):
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
        return self.from_projections(self.gate_proj(x), self.up_proj(x))

    def from_projections(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """down_proj(act(gate, up)) from gate = gate_proj(x) and up = up_proj(x), however they were computed
        (the MoE's decode step joins them with its other projections of x)."""
        if self.activation == "situ":
            hidden = situ(gate, up, self.situ_beta, self.situ_linear_beta)
        else:
            hidden = F.silu(gate) * up
        return self.down_proj(hidden)

    def extra_repr(self) -> str:
        if self.activation == "situ":
            return f"activation=situ, beta={self.situ_beta}, linear_beta={self.situ_linear_beta}"
        return "activation=swiglu"
