"""The linear-attention family of layers: LinearAttention, DeltaNet, Gated DeltaNet and Kimi Delta
Attention (KDA).

LinearAttention (Katharopoulos et al.): phi(x) = ELU(x) + 1 on q and k, the normalised op of
`k3.ops.linear_attn`, o_proj.

The three delta-rule layers share one body and one `forward` (docs/design.md: the layers), read top to
bottom as fla's: project, short conv + SiLU, L2-normalise q and k, the gates, the chunk or recurrent op,
output norm and gate, o_proj. They differ only in the forget gate (`decay`, each variant's formula):

    q, k, v = SiLU(ShortConv(W_q x)), SiLU(ShortConv(W_k x)), SiLU(ShortConv(W_v x))   per head, q, k L2-normalised
    beta    = sigmoid(b_proj(x))                                                        write strength [B, T, H]
    g       = none (DeltaNet)
            | -exp(A_log[h]) * softplus(a_proj(x) + dt_bias[h])                         Gated DeltaNet, [B, T, H]
            | -exp(A_log[h]) * softplus(f_b(f_a(x)) + dt_bias)                          KDA (Kimi Linear), [B, T, H, K]
            | lower_bound * sigmoid(exp(A_log[h]) * (f_b(f_a(x)) + dt_bias))            KDA (Kimi K3's safe gate: -5)
    o       = the mixer of `k3.ops` (chunkwise for prefill, recurrent for one-token decode)
    y       = o_proj( RMSNorm_per_head(o) * sigmoid(output gate) )

Parameter names and shapes follow the Kimi Linear checkpoints (q_proj, q_conv1d, A_log [1, 1, H, 1],
dt_bias, b_proj, f_a_proj, f_b_proj, g_a_proj, g_b_proj, o_norm, o_proj), so weights map by name.

Three things here are called a gate, each by its own name: the forget gate g (`forget_gate(x)`, the log
decay the ops take; `decay(f)` from its projection f), KDA's formula for it (`kda_gate`: "kimi_linear" or
K3's "safe"), and the output gate (`output_gate`: its form, "low_rank", "full" or None).

Decoding state lives in the layer's part of the cache the caller owns (`k3.inference.cache`): the three
convolution states as one window and the recurrent state [N, H, K, V], zero for a new sequence and
overwritten in place by `forward`. Its size does not grow with the sequence. One token through a cache runs
a lean path of `forward`: the convolutions' rolling window and the op's `*_step` function, without the
public op's validation, casts and token-loop frame.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import (
    chunk_delta_rule,
    chunk_gated_delta_rule,
    chunk_kda,
    chunk_linear_attn,
    l2norm,
)
from ..ops.common import cast
from ..ops.delta_rule import delta_rule_step
from ..ops.gated_delta_rule import gated_delta_rule_step
from ..ops.kda import kda_step
from ..ops.linear_attn import linear_attn_step
from . import init
from .checks import check_mixer_input
from .conv import ShortConvolution, joint_window_step
from .init import init_linear
from .joined import join, project
from .norm import RMSNorm, upcast

OUTPUT_GATES = (None, "low_rank", "full")
KDA_GATES = ("kimi_linear", "safe")


def _inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


def init_decay(A_log: torch.Tensor, dt_bias: torch.Tensor) -> None:
    """A_log = log U(1, 16); dt_bias = inverse-softplus(dt), dt ~ logU(1e-3, 0.1) (Mamba2 / fla)."""
    with torch.no_grad():
        init.uniform_(A_log, 1, 16).log_()
        init.uniform_(dt_bias, math.log(1e-3), math.log(0.1))
        dt_bias.copy_(_inverse_softplus(dt_bias.exp()))


class _DeltaRuleAttention(nn.Module):
    """The body DeltaNet, GatedDeltaNet and KimiDeltaAttention share (see the module docstring): one
    `forward`. A variant names its ops (chunk, and the one-token step), the projection its
    forget gate starts from (`forget_input`: none in DeltaNet) and the gate's formula (`decay`), and makes
    and initialises that gate's parameters in its own `__init__` and `reset_parameters`."""

    chunk_op = staticmethod(chunk_delta_rule)
    step_op = staticmethod(delta_rule_step)
    forget_input: str | None = None  # the forget gate's projection of x ("a_proj", "f_a_proj"); None: no gate

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        *,
        output_gate: str | None = "full",
        conv_size: int = 4,
        norm_eps: float = 1e-6,
        chunk_size: int = 64,
    ):
        super().__init__()
        if output_gate not in OUTPUT_GATES:
            raise ValueError(
                f"{type(self).__name__}: `output_gate` must be None, 'low_rank' or 'full', got {output_gate!r}"
            )
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.output_gate, self.chunk_size = output_gate, chunk_size
        inner = num_heads * head_dim
        self.q_proj = nn.Linear(hidden_size, inner, bias=False)
        self.k_proj = nn.Linear(hidden_size, inner, bias=False)
        self.v_proj = nn.Linear(hidden_size, inner, bias=False)
        self.q_conv1d = ShortConvolution(inner, conv_size)
        self.k_conv1d = ShortConvolution(inner, conv_size)
        self.v_conv1d = ShortConvolution(inner, conv_size)
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        if output_gate == "low_rank":
            self.g_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
            self.g_b_proj = nn.Linear(head_dim, inner, bias=False)
        elif output_gate == "full":
            self.g_proj = nn.Linear(hidden_size, inner, bias=False)
        self.o_norm = RMSNorm(head_dim, eps=norm_eps)
        self.o_proj = nn.Linear(inner, hidden_size, bias=False)

    def reset_parameters(self, std: float | None = None, residual_std: float | None = None) -> None:
        """See k3.layers.init: projections ~ N(0, std), o_proj ~ N(0, residual_std), the short
        convolutions as nn.Conv1d, o_norm 1 (a gated variant then initialises its forget gate)."""
        gates = {"low_rank": ("g_a_proj", "g_b_proj"), "full": ("g_proj",), None: ()}[self.output_gate]
        for linear in (self.q_proj, self.k_proj, self.v_proj, self.b_proj, *(getattr(self, g) for g in gates)):
            init_linear(linear, std)
        init_linear(self.o_proj, std if residual_std is None else residual_std)
        for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            conv.reset_parameters()
        self.o_norm.reset_parameters()

    def decay(self, f: torch.Tensor) -> torch.Tensor:
        """The forget gate's projection of x (`forget_input`) -> the log decay g in float32 (the variant's formula)."""
        raise NotImplementedError(f"{type(self).__name__} has no forget gate")

    def chunk_options(self) -> dict:
        """Keyword arguments of the variant's chunk op beyond the shared ones."""
        return {}

    def forget_gate(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [..., hidden_size] -> log decay g in float32: None (DeltaNet), [..., H] or [..., H, K]."""
        return None if self.forget_input is None else self.decay(getattr(self, self.forget_input)(x))

    def _input_projections(self) -> list[nn.Linear]:
        """Every projection of x, in the order `forward` reads them (and `fuse_for_decoding` joins them): q, k,
        v (side by side, as the joint conv window reads them), beta, the forget gate's, the output gate's."""
        forget = [] if self.forget_input is None else [getattr(self, self.forget_input)]
        output = {"low_rank": ["g_a_proj"], "full": ["g_proj"], None: []}[self.output_gate]
        return [self.q_proj, self.k_proj, self.v_proj, self.b_proj, *forget, *(getattr(self, g) for g in output)]

    def fuse_for_decoding(self) -> torch.Tensor:
        """The input projections' weights joined (`k3.layers.joined`): what a decode step passes as `fused`."""
        return join(self._input_projections())

    def forward(self, x: torch.Tensor, cache=None, fused: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, hidden_size] -> y [B, T, hidden_size]; with `cache`, continue from its state and leave
        the new state in it. Three paths, chosen by the shapes: the whole sequence (no cache, or a prefill
        through one) runs the chunk op (the recurrent op for a first single token); one token after a
        state runs on [B, ...] tensors with no time axis, the three convolutions as one rolling window and
        the op's one-token step. `fused`: the decode step's joined copy of the input projections
        (`fuse_for_decoding`), one matmul instead of five or six."""
        check_mixer_input(type(self).__name__, x, self.hidden_size, cache)
        B, T, _ = x.shape
        H, Dh = self.num_heads, self.head_dim
        state = None if cache is None else cache.recurrent_state
        one_step = T == 1 and state is not None
        h = x[:, 0] if one_step else x  # [B, hidden_size] for one step, else [B, T, hidden_size]

        # the projections of x; the gates (float32: the ops accumulate in it, and it keeps the gates exact in bf16)
        q, k, v, b, *gates = project(h, self._input_projections(), fused)
        g = None if self.forget_input is None else self.decay(gates.pop(0))
        gate_args = () if g is None else (g,)
        beta = torch.sigmoid(upcast(b))
        out_gate = gates[0] if gates else None
        if self.output_gate == "low_rank":
            out_gate = self.g_b_proj(out_gate)

        if one_step:  # short conv + SiLU as one window, q and k L2-normalised here, the op's step
            y, window = joint_window_step([self.q_conv1d, self.k_conv1d, self.v_conv1d], [q, k, v], cache.conv_window())
            qkv = upcast(y).view(B, 3, H, Dh)
            q, k = l2norm(qkv[:, :2]).unbind(1)  # [B, H, Dh] each
            o, state = self.step_op(q, k, qkv[:, 2], *gate_args, beta, state, Dh**-0.5)
            cache.store(state, conv_window=window)
        else:  # short conv + SiLU per projection (continuing the cache's), q and k L2-normalised by the op
            keep = cache is not None
            conv_in = (None,) * 3 if cache is None or cache.conv_states is None else cache.conv_states
            q, conv_q = self.q_conv1d(q, conv_in[0], keep)
            k, conv_k = self.k_conv1d(k, conv_in[1], keep)
            v, conv_v = self.v_conv1d(v, conv_in[2], keep)
            q, k, v = (upcast(t).view(B, T, H, Dh) for t in (q, k, v))
            o, state = self.chunk_op(
                q,
                k,
                v,
                *gate_args,
                beta,
                initial_state=state,
                output_final_state=keep,
                use_qk_l2norm=True,
                chunk_size=self.chunk_size,
                check_values=False,
                **self.chunk_options(),
            )
            if keep:
                cache.store(state, conv_states=(conv_q, conv_k, conv_v))

        # per-head RMSNorm times sigmoid(output gate), o_proj
        o = self.o_norm(o, None if out_gate is None else out_gate.view(o.shape))
        y = self.o_proj(cast(o.reshape(*h.shape[:-1], -1), x.dtype))
        return y.unsqueeze(1) if one_step else y


class DeltaNet(_DeltaRuleAttention):
    """DeltaNet: S_t = S_{t-1} + beta_t k_t^T (v_t - k_t S_{t-1}); o_t = scale q_t S_t (no forget gate)."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, **kwargs):
        super().__init__(hidden_size, num_heads, head_dim, **kwargs)
        self.reset_parameters()


class GatedDeltaNet(_DeltaRuleAttention):
    """Gated DeltaNet: one decay per head and token, g = -exp(A_log) softplus(a_proj(x) + dt_bias)."""

    chunk_op = staticmethod(chunk_gated_delta_rule)
    step_op = staticmethod(gated_delta_rule_step)
    forget_input = "a_proj"

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, **kwargs):
        super().__init__(hidden_size, num_heads, head_dim, **kwargs)
        self.a_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.A_log = nn.Parameter(torch.empty(num_heads))
        self.dt_bias = nn.Parameter(torch.empty(num_heads))
        self.reset_parameters()

    def reset_parameters(self, std: float | None = None, residual_std: float | None = None) -> None:
        """The shared body's (see `_DeltaRuleAttention`), a_proj ~ N(0, std), A_log and dt_bias (`init_decay`)."""
        super().reset_parameters(std, residual_std)
        init_linear(self.a_proj, std)
        init_decay(self.A_log, self.dt_bias)

    def decay(self, f: torch.Tensor) -> torch.Tensor:
        """a_proj(x) [..., H] -> g = -exp(A_log) softplus(a_proj(x) + dt_bias) [..., H] (float32)."""
        return -torch.exp(upcast(self.A_log)) * F.softplus(upcast(f) + upcast(self.dt_bias))


class KimiDeltaAttention(_DeltaRuleAttention):
    """KDA: a decay per head, token and key channel from a low-rank forget gate f = f_b(f_a(x)).

    kda_gate="kimi_linear": g = -exp(A_log[h]) softplus(f + dt_bias)         (unbounded below)
    kda_gate="safe" (K3):   g = b sigmoid(exp(A_log[h]) (f + dt_bias))       (every step g >= b; K3: b = -5,
                                                                              `gate_lower_bound`)
    output_gate defaults to the low-rank g_b(g_a(x)) of Kimi Linear; K3 uses "full".
    """

    chunk_op = staticmethod(chunk_kda)
    step_op = staticmethod(kda_step)
    forget_input = "f_a_proj"

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        *,
        kda_gate: str = "kimi_linear",
        gate_lower_bound: float = -5.0,
        output_gate: str | None = "low_rank",
        **kwargs,
    ):
        if kda_gate not in KDA_GATES:
            raise ValueError(f"KimiDeltaAttention: `kda_gate` must be 'kimi_linear' or 'safe', got {kda_gate!r}")
        if not gate_lower_bound < 0:
            raise ValueError(f"KimiDeltaAttention: `gate_lower_bound` must be negative, got {gate_lower_bound}")
        super().__init__(hidden_size, num_heads, head_dim, output_gate=output_gate, **kwargs)
        self.kda_gate, self.gate_lower_bound = kda_gate, float(gate_lower_bound)
        self.f_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, num_heads * head_dim, bias=False)
        self.A_log = nn.Parameter(torch.empty(1, 1, num_heads, 1))  # the checkpoints' shape
        self.dt_bias = nn.Parameter(torch.empty(num_heads * head_dim))
        self.reset_parameters()

    def reset_parameters(self, std: float | None = None, residual_std: float | None = None) -> None:
        """The shared body's (see `_DeltaRuleAttention`), f_a and f_b ~ N(0, std), A_log and dt_bias
        (`init_decay`)."""
        super().reset_parameters(std, residual_std)
        init_linear(self.f_a_proj, std)
        init_linear(self.f_b_proj, std)
        init_decay(self.A_log, self.dt_bias)

    def chunk_options(self) -> dict:
        """The safe gate's bound (g >= gate_lower_bound by construction) lets chunk_kda factor larger blocks."""
        return {"lower_bound": self.gate_lower_bound} if self.kda_gate == "safe" else {}

    def decay(self, f: torch.Tensor) -> torch.Tensor:
        """f_a_proj(x) [..., K] -> log decay g [..., H, K] (float32), by the `kda_gate` formula."""
        H = self.num_heads
        f = (upcast(self.f_b_proj(f)) + upcast(self.dt_bias)).view(*f.shape[:-1], H, -1)
        rate = torch.exp(upcast(self.A_log)).view(H, 1)  # one rate per head
        if self.kda_gate == "safe":
            return self.gate_lower_bound * torch.sigmoid(rate * f)
        return -rate * F.softplus(f)


class LinearAttention(nn.Module):
    """Linear attention with the ELU+1 feature map: o_t = phi(q_t) S_t / (phi(q_t) . z_t + eps),
    S_t = S_{t-1} + phi(k_t)^T v_t, z_t = z_{t-1} + phi(k_t); y = o_proj(o). The state (S, z) is the cache."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, *, chunk_size: int = 64):
        super().__init__()
        self.hidden_size, self.num_heads, self.head_dim, self.chunk_size = hidden_size, num_heads, head_dim, chunk_size
        inner = num_heads * head_dim
        self.q_proj = nn.Linear(hidden_size, inner, bias=False)
        self.k_proj = nn.Linear(hidden_size, inner, bias=False)
        self.v_proj = nn.Linear(hidden_size, inner, bias=False)
        self.o_proj = nn.Linear(inner, hidden_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self, std: float | None = None, residual_std: float | None = None) -> None:
        """See k3.layers.init: q, k, v ~ N(0, std), o_proj ~ N(0, residual_std)."""
        for linear in (self.q_proj, self.k_proj, self.v_proj):
            init_linear(linear, std)
        init_linear(self.o_proj, std if residual_std is None else residual_std)

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        """x [B, T, hidden_size] -> y [B, T, hidden_size]; with `cache`, continue from (S, z) and update it."""
        check_mixer_input("LinearAttention", x, self.hidden_size, cache)
        B, T, _ = x.shape
        state = None if cache is None else cache.recurrent_state
        if T == 1 and state is not None:  # decode: [B, ...] tensors and the op's lean step
            q, k, v = self._features(x[:, 0])
            o, state = linear_attn_step(q, k, v, state, self.head_dim**-0.5)
            cache.store(state)
            return self.o_proj(cast(o.reshape(B, -1), x.dtype)).unsqueeze(1)
        q, k, v = self._features(x)
        o, state = chunk_linear_attn(
            q,
            k,
            v,
            initial_state=state,
            output_final_state=cache is not None,
            chunk_size=self.chunk_size,
            check_values=False,
        )
        if cache is not None:
            cache.store(state)
        return self.o_proj(cast(o.reshape(B, T, -1), x.dtype))

    def _features(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., hidden_size] -> phi(q), phi(k), v [..., H, head_dim] in float32 (phi = ELU + 1)."""
        shape = (*x.shape[:-1], self.num_heads, self.head_dim)
        q = F.elu(upcast(self.q_proj(x)).view(shape)) + 1.0
        k = F.elu(upcast(self.k_proj(x)).view(shape)) + 1.0
        return q, k, upcast(self.v_proj(x)).view(shape)
