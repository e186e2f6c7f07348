"""The linear-attention family of layers: LinearAttention, DeltaNet, Gated DeltaNet and Kimi Delta
Attention (KDA).

LinearAttention (Katharopoulos et al.): phi(x) = ELU(x) + 1 on q and k, the normalised op of
`k3.ops.linear_attn`, o_proj.

The three delta-rule layers share one body (docs/design.md: the layers) and differ only in the forget gate:

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
decay the ops take), KDA's formula for it (`kda_gate`: "kimi_linear" or K3's "safe"), and the output
gate (`output_gate`: its form, "low_rank", "full" or None).

Decoding state lives in a `RecurrentCache` the caller owns: the three convolution states and the
recurrent state [N, H, K, V], updated in place by `forward`. Its size does not grow with the sequence.
One token from a cache that holds state runs a lean step (`_decode`): the convolutions' rolling window and
the op's `*_step` function, without the public op's validation, casts and token-loop frame, which the
prefill already paid for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import (
    chunk_delta_rule, chunk_gated_delta_rule, chunk_kda, chunk_linear_attn, l2norm, recurrent_delta_rule,
    recurrent_gated_delta_rule, recurrent_kda, recurrent_linear_attn,
)
from ..ops.common import cast
from ..ops.delta_rule import delta_rule_step
from ..ops.gated_delta_rule import gated_delta_rule_step
from ..ops.kda import kda_step
from ..ops.linear_attn import linear_attn_step
from .cache import LayerCache
from .checks import check_mixer_input
from .conv import ShortConvolution, joint_window_step
from .joined import joined_linear, prepare_joined
from . import init
from .init import init_linear
from .norm import RMSNorm, upcast

OUTPUT_GATES = (None, "low_rank", "full")
KDA_GATES = ("kimi_linear", "safe")


@dataclass
class RecurrentCache(LayerCache):
    """Decode state of one linear-family layer: conv states (q, k, v) [N, D, W-1] (None for plain
    linear attention) and the recurrent state, [N, H, K, V] (or (S, z) for linear attention)."""

    conv_states: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    recurrent_state: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None

    tensor_fields = ("conv_states", "recurrent_state")  # nothing grows with the sequence

    def conv_window(self) -> torch.Tensor:
        """The three conv states joined along the channels, [N, 3D, W-1] (what a decode step reads)."""
        return torch.cat(self.conv_states, dim=1)

    def store(self, recurrent_state, conv_states=None, conv_window: torch.Tensor | None = None) -> None:
        """Keep a forward's new state: the recurrent state, and the conv states as three tensors or as one
        joined window [N, 3D, W-1] (split here). A growing cache adopts the tensors given."""
        if conv_window is not None:
            conv_states = tuple(conv_window.split(conv_window.shape[1] // 3, dim=1))
        if conv_states is not None:
            self.conv_states = tuple(conv_states)
        self.recurrent_state = recurrent_state


class StaticRecurrentCache(RecurrentCache):
    """A linear-family layer's decode state in buffers allocated once, updated in place (transformers'
    static linear-attention layers; vLLM's state pool): the three conv states as one window
    [N, 3D, W-1] (`conv_window`, read whole by a decode step; `conv_states` gives its three views) and the
    recurrent state [N, H, K, V] (linear attention: (S, z)). They start at zero, which is a fresh
    sequence's state; `store` copies a forward's new state into them, so their addresses never change."""

    static = True

    def __init__(self, window: torch.Tensor | None, recurrent_state):
        self._window, self.recurrent_state = window, recurrent_state

    @property
    def conv_states(self):
        return None if self._window is None else tuple(self._window.split(self._window.shape[1] // 3, dim=1))

    def conv_window(self) -> torch.Tensor:
        return self._window

    def buffers(self) -> list[torch.Tensor]:
        """The tensors allocated for this cache: the conv window (when the layer has convolutions) and the state(s)."""
        return [t for t in (self._window, *_as_tuple(self.recurrent_state)) if t is not None]

    def store(self, recurrent_state, conv_states=None, conv_window: torch.Tensor | None = None) -> None:
        if conv_window is not None:
            self._window.copy_(conv_window)
        elif conv_states is not None:
            D = self._window.shape[1] // 3
            for i, state in enumerate(conv_states):  # narrow: one view at a time (split's may not be written)
                self._window.narrow(1, i * D, D).copy_(state)
        for buffer, state in zip(_as_tuple(self.recurrent_state), _as_tuple(recurrent_state)):
            buffer.copy_(state)

    def reorder(self, index: torch.Tensor) -> None:
        raise NotImplementedError("StaticRecurrentCache: a static cache keeps its rows in place; reorder a "
                                  "growing cache (model.new_cache(batch_size) without max_length)")


def _as_tuple(state) -> tuple:
    return tuple(state) if isinstance(state, (tuple, list)) else (state,)


def _inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


def init_decay(A_log: torch.Tensor, dt_bias: torch.Tensor) -> None:
    """A_log = log U(1, 16); dt_bias = inverse-softplus(dt), dt ~ logU(1e-3, 0.1) (Mamba2 / fla)."""
    with torch.no_grad():
        init.uniform_(A_log, 1, 16).log_()
        init.uniform_(dt_bias, math.log(1e-3), math.log(0.1))
        dt_bias.copy_(_inverse_softplus(dt_bias.exp()))


class _DeltaRuleAttention(nn.Module):
    """Shared body of DeltaNet, GatedDeltaNet and KimiDeltaAttention (see the module docstring). A
    subclass names its ops (chunk, recurrent, and the decode step) and adds its forget gate
    (`_make_forget_gate`, `forget_gate`)."""

    chunk_op = staticmethod(chunk_delta_rule)
    recurrent_op = staticmethod(recurrent_delta_rule)
    step_op = staticmethod(delta_rule_step)

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, *, output_gate: str | None = "full",
                 conv_size: int = 4, norm_eps: float = 1e-6, chunk_size: int = 64):
        super().__init__()
        if output_gate not in OUTPUT_GATES:
            raise ValueError(f"{type(self).__name__}: `output_gate` must be None, 'low_rank' or 'full', "
                             f"got {output_gate!r}")
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
        self._make_forget_gate()
        self.reset_parameters()

    def reset_parameters(self, std: float | None = None, residual_std: float | None = None) -> None:
        """See k3.layers.init: projections ~ N(0, std), o_proj ~ N(0, residual_std), the short
        convolutions as nn.Conv1d, o_norm 1, and the forget gate's own (`_reset_forget_gate`)."""
        gates = {"low_rank": ("g_a_proj", "g_b_proj"), "full": ("g_proj",), None: ()}[self.output_gate]
        for linear in (self.q_proj, self.k_proj, self.v_proj, self.b_proj, *(getattr(self, g) for g in gates)):
            init_linear(linear, std)
        init_linear(self.o_proj, std if residual_std is None else residual_std)
        for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            conv.reset_parameters()
        self.o_norm.reset_parameters()
        self._reset_forget_gate(std)

    # -- the forget gate: DeltaNet has none; the gated variants override these four ------------------
    def _make_forget_gate(self) -> None:
        pass

    def _reset_forget_gate(self, std: float | None) -> None:
        pass

    def _gate_projections(self) -> list[nn.Linear]:
        """The projections of x the forget gate starts from (none, or one: a_proj, f_a_proj)."""
        return []

    def _gate_from(self, first: torch.Tensor | None) -> torch.Tensor | None:
        """The log decay g (float32) from the output of `_gate_projections` (None: no gate)."""
        return None

    def forget_gate(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [..., hidden_size] -> log decay g in float32: None here, [..., H] or [..., H, K] in the gated layers."""
        projections = self._gate_projections()
        return self._gate_from(projections[0](x) if projections else None)

    def _output_gate_projections(self) -> list[nn.Linear]:
        return {"low_rank": [getattr(self, "g_a_proj", None)], "full": [getattr(self, "g_proj", None)],
                None: []}[self.output_gate]

    def _output_gate_from(self, first: torch.Tensor | None) -> torch.Tensor | None:
        if self.output_gate == "low_rank":
            return self.g_b_proj(first)
        return first  # "full": the projection itself; None: no gate

    def _gates(self, extra: list[torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(the forget gate g, the output gate's pre-activation) from the outputs of `_input_projections`
        after q, k, v and beta (each None where the layer has no such gate)."""
        n = len(self._gate_projections())
        return self._gate_from(extra[0] if n else None), self._output_gate_from(extra[n] if len(extra) > n else None)

    def _input_projections(self) -> list[nn.Linear]:
        """Every projection of the layer's input, in the order a decode step joins them (`k3.layers.joined`):
        q, k, v (side by side, as the joint conv window reads them), beta, the forget gate's, the output
        gate's."""
        return [self.q_proj, self.k_proj, self.v_proj, self.b_proj, *self._gate_projections(),
                *self._output_gate_projections()]

    def prepare_decode(self) -> None:
        """Join the input projections before a decode step is compiled (`k3.models.decode_step.prepare`)."""
        prepare_joined(self, "inputs", self._input_projections())

    def new_static_cache(self, owner, batch_size: int, max_length: int) -> StaticRecurrentCache:
        """Zeroed conv window [B, 3 H Dh, W-1] (the model's dtype) and recurrent state [B, H, Dh, Dh]
        (float32; float64 in a float64 model); `owner` and `max_length` are not needed: nothing grows."""
        w = self.q_proj.weight
        inner, W = self.num_heads * self.head_dim, self.q_conv1d.kernel_size
        state = torch.zeros(batch_size, self.num_heads, self.head_dim, self.head_dim, dtype=upcast(w).dtype,
                            device=w.device)
        return StaticRecurrentCache(w.new_zeros(batch_size, 3 * inner, W - 1), state)

    def forward(self, x: torch.Tensor, cache: RecurrentCache | None = None) -> torch.Tensor:
        """x [B, T, hidden_size] -> y [B, T, hidden_size]. With `cache`, continue from its state and
        leave the new state in it (prefill runs the chunk form; one token after a state runs `_decode`)."""
        check_mixer_input(type(self).__name__, x, self.hidden_size, cache)
        B, T, _ = x.shape
        if T == 1 and cache is not None and cache.recurrent_state is not None:
            return self._decode(x, cache)
        H, Dh = self.num_heads, self.head_dim
        conv_in = (None,) * 3 if cache is None or cache.conv_states is None else cache.conv_states
        keep = cache is not None
        q, k, v, b, *gates = joined_linear(self, "inputs", self._input_projections(), x)
        q, conv_q = self.q_conv1d(q, conv_in[0], keep)
        k, conv_k = self.k_conv1d(k, conv_in[1], keep)
        v, conv_v = self.v_conv1d(v, conv_in[2], keep)
        # the ops accumulate in float32 anyway; feeding them float32 keeps the gates exact in bf16 models
        q, k, v = (upcast(t).view(B, T, H, Dh) for t in (q, k, v))
        beta = torch.sigmoid(upcast(b))
        g, out_gate = self._gates(gates)
        gate_args = () if g is None else (g,)

        state = None if cache is None else cache.recurrent_state
        if cache is not None and T == 1:  # a first token, with no state yet
            o, state = self.recurrent_op(q, k, v, *gate_args, beta, initial_state=state, output_final_state=True,
                                         use_qk_l2norm=True)
        else:
            o, state = self.chunk_op(q, k, v, *gate_args, beta, initial_state=state, output_final_state=keep,
                                     use_qk_l2norm=True, chunk_size=self.chunk_size)
        if cache is not None:
            cache.store(state, conv_states=(conv_q, conv_k, conv_v))
        return self._output(o, x, out_gate)

    def _decode(self, x: torch.Tensor, cache: RecurrentCache) -> torch.Tensor:
        """One token after the state in `cache`: x [B, 1, hidden_size] -> y [B, 1, hidden_size], the same
        maths as `forward` with every tensor [B, ...] (no time axis): the input projections as one matmul
        (`joined_linear`), the three short convolutions as one rolling window (`joint_window_step`), q and
        k normalised together, and the op's `step_op`."""
        B = x.shape[0]
        H, Dh = self.num_heads, self.head_dim
        h = x[:, 0]  # [B, hidden_size]
        q, k, v, b, *gates = joined_linear(self, "inputs", self._input_projections(), h)
        y, window = joint_window_step([self.q_conv1d, self.k_conv1d, self.v_conv1d], [q, k, v], cache.conv_window())
        qkv = upcast(y).view(B, 3, H, Dh)
        q, k = l2norm(qkv[:, :2]).unbind(1)  # [B, H, Dh] each
        beta = torch.sigmoid(upcast(b))  # [B, H]
        g, out_gate = self._gates(gates)
        gate_args = () if g is None else (g,)
        # all float32 (float64 in a float64 model), as the state the prefill left
        o, state = self.step_op(q, k, qkv[:, 2], *gate_args, beta, cache.recurrent_state, Dh ** -0.5)
        cache.store(state, conv_window=window)
        return self._output(o, h, out_gate).unsqueeze(1)

    def _output(self, o: torch.Tensor, x: torch.Tensor, out_gate: torch.Tensor | None) -> torch.Tensor:
        """o [..., H, Dh] (the op's output for inputs x [..., hidden_size]) -> o_proj(o_norm(o) * sigmoid(out_gate)),
        out_gate the output gate's pre-activation (`_gates`; None: no output gate)."""
        o = self.o_norm(o, None if out_gate is None else out_gate.view(o.shape))
        return self.o_proj(cast(o.reshape(*x.shape[:-1], -1), x.dtype))


class DeltaNet(_DeltaRuleAttention):
    """DeltaNet: S_t = S_{t-1} + beta_t k_t^T (v_t - k_t S_{t-1}); o_t = scale q_t S_t (no forget gate)."""


class GatedDeltaNet(_DeltaRuleAttention):
    """Gated DeltaNet: one decay per head and token, g = -exp(A_log) softplus(a_proj(x) + dt_bias)."""

    chunk_op = staticmethod(chunk_gated_delta_rule)
    recurrent_op = staticmethod(recurrent_gated_delta_rule)
    step_op = staticmethod(gated_delta_rule_step)

    def _make_forget_gate(self) -> None:
        self.a_proj = nn.Linear(self.hidden_size, self.num_heads, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads))

    def _reset_forget_gate(self, std: float | None) -> None:
        init_linear(self.a_proj, std)
        init_decay(self.A_log, self.dt_bias)

    def _gate_projections(self) -> list[nn.Linear]:
        return [self.a_proj]

    def _gate_from(self, first: torch.Tensor) -> torch.Tensor:
        return -torch.exp(upcast(self.A_log)) * F.softplus(upcast(first) + upcast(self.dt_bias))


class KimiDeltaAttention(_DeltaRuleAttention):
    """KDA: a decay per head, token and key channel from a low-rank forget gate f = f_b(f_a(x)).

    kda_gate="kimi_linear": g = -exp(A_log[h]) softplus(f + dt_bias)         (unbounded below)
    kda_gate="safe" (K3):   g = b sigmoid(exp(A_log[h]) (f + dt_bias))       (every step g >= b; K3: b = -5,
                                                                              `gate_lower_bound`)
    output_gate defaults to the low-rank g_b(g_a(x)) of Kimi Linear; K3 uses "full".
    """

    chunk_op = staticmethod(chunk_kda)
    recurrent_op = staticmethod(recurrent_kda)
    step_op = staticmethod(kda_step)

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, *, kda_gate: str = "kimi_linear",
                 gate_lower_bound: float = -5.0, output_gate: str | None = "low_rank", **kwargs):
        if kda_gate not in KDA_GATES:
            raise ValueError(f"KimiDeltaAttention: `kda_gate` must be 'kimi_linear' or 'safe', got {kda_gate!r}")
        if not gate_lower_bound < 0:
            raise ValueError(f"KimiDeltaAttention: `gate_lower_bound` must be negative, got {gate_lower_bound}")
        self.kda_gate, self.gate_lower_bound = kda_gate, float(gate_lower_bound)
        super().__init__(hidden_size, num_heads, head_dim, output_gate=output_gate, **kwargs)

    def _make_forget_gate(self) -> None:
        H, K = self.num_heads, self.head_dim
        self.f_a_proj = nn.Linear(self.hidden_size, K, bias=False)
        self.f_b_proj = nn.Linear(K, H * K, bias=False)
        self.A_log = nn.Parameter(torch.empty(1, 1, H, 1))  # the checkpoints' shape
        self.dt_bias = nn.Parameter(torch.empty(H * K))

    def _reset_forget_gate(self, std: float | None) -> None:
        init_linear(self.f_a_proj, std)
        init_linear(self.f_b_proj, std)
        init_decay(self.A_log, self.dt_bias)

    def _gate_projections(self) -> list[nn.Linear]:
        return [self.f_a_proj]

    def _gate_from(self, first: torch.Tensor) -> torch.Tensor:
        """f_a_proj(x) [..., K] -> log decay g [..., H, K] (float32), by the `kda_gate` formula."""
        H = self.num_heads
        f = (upcast(self.f_b_proj(first)) + upcast(self.dt_bias)).view(*first.shape[:-1], H, -1)
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

    def new_static_cache(self, owner, batch_size: int, max_length: int) -> StaticRecurrentCache:
        """A zeroed state (S [B, H, K, V], z [B, H, K]) in float32 (float64 in a float64 model); no conv."""
        w = self.q_proj.weight
        dtype, H, D = upcast(w).dtype, self.num_heads, self.head_dim
        return StaticRecurrentCache(None, (torch.zeros(batch_size, H, D, D, dtype=dtype, device=w.device),
                                           torch.zeros(batch_size, H, D, dtype=dtype, device=w.device)))

    def forward(self, x: torch.Tensor, cache: RecurrentCache | None = None) -> torch.Tensor:
        """x [B, T, hidden_size] -> y [B, T, hidden_size]; with `cache`, continue from (S, z) and update it."""
        check_mixer_input("LinearAttention", x, self.hidden_size, cache)
        B, T, _ = x.shape
        state = None if cache is None else cache.recurrent_state
        if T == 1 and state is not None:  # decode: [B, ...] tensors and the op's lean step
            q, k, v = self._features(x[:, 0])
            o, state = linear_attn_step(q, k, v, state, self.head_dim ** -0.5)
            cache.store(state)
            return self.o_proj(cast(o.reshape(B, -1), x.dtype)).unsqueeze(1)
        q, k, v = self._features(x)
        if cache is not None and T == 1:  # a first token, with no state yet
            o, state = recurrent_linear_attn(q, k, v, initial_state=state, output_final_state=True)
        else:
            o, state = chunk_linear_attn(q, k, v, initial_state=state, output_final_state=cache is not None,
                                         chunk_size=self.chunk_size)
        if cache is not None:
            cache.store(state)
        return self.o_proj(cast(o.reshape(B, T, -1), x.dtype))

    def _features(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., hidden_size] -> phi(q), phi(k), v [..., H, head_dim] in float32 (phi = ELU + 1)."""
        shape = (*x.shape[:-1], self.num_heads, self.head_dim)
        q = F.elu(upcast(self.q_proj(x)).view(shape)) + 1.0
        k = F.elu(upcast(self.k_proj(x)).view(shape)) + 1.0
        return q, k, upcast(self.v_proj(x)).view(shape)
