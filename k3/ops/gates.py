"""Gated products inside a chunk: the delta family's scores, and the same products in the backward.

Within a chunk of C tokens with cumulative log decays G (per head, a scalar G_r or per channel G_rc),
every gated quantity is built from the decay between two positions, exp(G_rc - G_ic) for i <= r:

    scores       A_ri    = sum_c x_rc y_ic exp(G_rc - G_ic)            (x = q or k, y = k)
    lower apply  (M | Y)_rc = sum_{i<=r} M_ri Y_ic exp(G_rc - G_ic)     (M lower triangular)
    upper apply  (M | X)^T_ic = sum_{r>=i} M_ri X_rc exp(G_rc - G_ic)

The scores are the forward's A_qk and A_kk; the two applies are their gradients: for dA the gradient
of the scores, dx = lower(dA, y) and dy = upper(dA, x), and since G_r enters through x_r's factor and
G_i through y_i's, dG = x * dx - y * dy (the identity fla's KDA backward uses).

Three gates share the interface (`gate_of`): none (DeltaNet), one per head (Gated DeltaNet: the
decays form one C x C matrix) and one per key channel (KDA). The per-channel decays never form a
[C, C, K] tensor: `ChannelGate` factors each through a gate between i and r,

    exp(G_rc - G_ic) = exp(G_rc - G_pc) * exp(G_pc - G_ic),    i <= p < r,

so that the sums become matmuls of rows x_r exp(G_r - G_p) and columns y_i exp(G_p - G_i), with p
shared by many pairs: the gate just before r's sub-chunk of up to 32 tokens and the gate at the end of
i's (a third factor between them) for pairs in different sub-chunks, and inside one the middle of the
smallest half-block holding both (halving down to single tokens, or, with a stated bound on the gates,
to blocks factored whole: `k3.ops.channel_gate`). No branch on the gates' range and no value read back
from the device (a GPU stream never waits; `torch.compile(fullgraph=True)` traces it whole).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .channel_gate import MAX_SUB_CHUNK, ChannelGate, _sum, halving_levels, sub_chunk_size
from .numerics import decay_exp
from .ut import BlockLower

__all__ = ["MAX_SUB_CHUNK", "ChannelGate", "HeadGate", "NoGate", "gate_of", "halving_levels", "sub_chunk_size"]


@lru_cache(maxsize=64)
def lower_masks(C: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """0/1 lower-triangular masks [C, C]: inclusive (q rows: i <= r) and strict (k rows: i < r).
    Ordinary tensors even when first asked for in inference mode, so that autograd can save them."""
    with torch.inference_mode(False):
        incl = torch.ones(C, C, dtype=dtype, device=device).tril()
        return incl, incl.tril(-1)


def gate_of(
    G: torch.Tensor | None, C: int, dtype: torch.dtype, device, lower_bound: float | None = None
) -> "NoGate | HeadGate | ChannelGate":
    """The gate for cumulative log decays G: None (no decay), [P, C, 1] (per head) or [P, C, K] (with
    `lower_bound` every step's g >= it, see `ChannelGate`)."""
    if G is None:
        return NoGate(C, dtype, device)
    return ChannelGate(G, lower_bound) if G.shape[-1] > 1 else HeadGate(G)


def gate_tensors(gate) -> tuple[list[str], list[torch.Tensor], dict]:
    """A gate taken apart for `ctx.save_for_backward`: the names and tensors of its factors, and the rest
    of its state (sizes; KDA's indices of unsafe sub-chunks). `gate_from_tensors` puts it back together.
    Factors the gate can rebuild cheaply from the others (`derived`: three of KDA's four of the keys'
    size) are not kept."""
    derived = getattr(gate, "derived", ())
    names = sorted(n for n, x in vars(gate).items() if isinstance(x, torch.Tensor) and n not in derived)
    rest = {n: x for n, x in vars(gate).items() if n not in names and n not in derived}
    return names, [getattr(gate, n) for n in names], {"type": type(gate), **rest}


def gate_from_tensors(names: list[str], tensors, rest: dict):
    """The gate `gate_tensors` took apart (the tensors as autograd unpacked them)."""
    rest = dict(rest)
    gate = object.__new__(rest.pop("type"))
    vars(gate).update(rest)
    vars(gate).update(zip(names, tensors))
    if getattr(gate, "derived", ()):
        gate.restore_derived()
    return gate


class NoGate:
    """DeltaNet: no decay, every factor is 1."""

    def __init__(self, C: int, dtype, device):
        self.C = C
        self.incl, self.strict = lower_masks(C, dtype, device)
        self.decay_end = None

    def intra(self, q, k):
        """A_qk (incl. diagonal) and A_kk (strict) as `BlockLower` [P, C, C], q * Gamma, k * Gamma,
        k * exp(G_C - G) [P, C, K] and exp(G_C) (None without a gate). q, k [P, C, K]."""
        blocks = lambda A: BlockLower.split(A, sub_chunk_size(self.C))  # noqa: E731
        k_t = k.transpose(-1, -2)
        return blocks((q @ k_t) * self.incl), blocks((k @ k_t) * self.strict), q, k, k, None

    def start_factor(self):
        """Gamma = exp(G), the decays from the chunk start, in the rows' shape [P, C, K|1] (None: 1)."""
        return None

    def end_factor(self):
        """exp(G_C - G), the decays to the chunk end (None: 1)."""
        return None

    def lower(self, Ms, Y):
        """sum_{i<=r} M_ri Y_i for each M of Ms (`BlockLower` [P, C, C]), Y [P, C, K]: a list."""
        return [M.matmul(Y)[0] for M in Ms]

    def upper_sum(self, *pairs):
        """sum over (M, X) of sum_{r>=i} M_ri X_r (M `BlockLower`, X [P, C, K])."""
        return _sum(M.t_matmul(X)[0] for M, X in pairs)

    def channel_sum(self, x):
        """A gradient w.r.t. G in G's shape."""
        return x


class HeadGate(NoGate):
    """Gated DeltaNet: one decay per head and position, G [P, C, 1]; the decays form one matrix
    exp(G_r - G_i) [P, C, C], taken where the exponent is <= 0."""

    def __init__(self, G: torch.Tensor):
        super().__init__(G.shape[-2], G.dtype, G.device)
        self.decay = decay_exp((G - G.transpose(-1, -2)).clamp(max=0.0))  # exp(G_r - G_i) for i <= r
        self.gamma = decay_exp(G)  # Gamma_r = exp(G_r) <= 1
        G_last = G[:, -1:]
        self.to_end = decay_exp(G_last - G)
        self.decay_end = decay_exp(G_last.squeeze(-2))  # [P, 1]

    def intra(self, q, k):
        blocks = lambda A: BlockLower.split(A, sub_chunk_size(self.C))  # noqa: E731
        k_t = k.transpose(-1, -2)
        return (
            blocks((q @ k_t) * (self.decay * self.incl)),
            blocks((k @ k_t) * (self.decay * self.strict)),
            q * self.gamma,
            k * self.gamma,
            k * self.to_end,
            self.decay_end,
        )

    def start_factor(self):
        return self.gamma

    def end_factor(self):
        return self.to_end

    def lower(self, Ms, Y):
        decay = BlockLower.split(self.decay, sub_chunk_size(self.C))
        return [M.mul(decay).matmul(Y)[0] for M in Ms]

    def upper_sum(self, *pairs):
        decay = BlockLower.split(self.decay, sub_chunk_size(self.C))
        return _sum(M.mul(decay).t_matmul(X)[0] for M, X in pairs)

    def channel_sum(self, x):
        return x.sum(-1, keepdim=True)
