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
[C, C, K] tensor: `ChannelGate` factors them around sub-chunks of up to 32 tokens, as the scores'
docstring explains, with every factor a normal number (`k3.ops.numerics`).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F

from .numerics import DECAY_FLUSH, FACTOR_EXP_LIMIT, decay_exp
from .ut import BlockLower

MAX_SUB_CHUNK = 32  # most tokens per sub-chunk: the diagonal blocks of the score matrices and of the UT transform


def sub_chunk_size(C: int) -> int:
    """The size s of the sub-chunks a chunk of C tokens is split into: the largest divisor of C up to
    MAX_SUB_CHUNK."""
    return max(s for s in range(1, min(MAX_SUB_CHUNK, C) + 1) if C % s == 0)


@lru_cache(maxsize=64)
def lower_masks(C: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """0/1 lower-triangular masks [C, C]: inclusive (q rows: i <= r) and strict (k rows: i < r).
    Ordinary tensors even when first asked for in inference mode, so that autograd can save them."""
    with torch.inference_mode(False):
        incl = torch.ones(C, C, dtype=dtype, device=device).tril()
        return incl, incl.tril(-1)


def gate_of(G: torch.Tensor | None, C: int, dtype: torch.dtype, device) -> "NoGate | HeadGate | ChannelGate":
    """The gate for cumulative log decays G: None (no decay), [P, C, 1] (per head) or [P, C, K]."""
    if G is None:
        return NoGate(C, dtype, device)
    return ChannelGate(G) if G.shape[-1] > 1 else HeadGate(G)


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


def _sum(terms):
    """The sum of an iterable of tensors, accumulated in place into the first."""
    total = None
    for term in terms:
        total = term if total is None else total.add_(term)
    return total


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


class ChannelGate:
    """KDA: one decay per key channel, G [P, C, K], factored around sub-chunks a, b of s <= 32 tokens.

    Decay r,i (r in sub-chunk a, i in b, i <= r) for channel c:
    - diagonal block (a = b): around G_mid(a), the cumulative gate at the middle of a:
      exp(G_r - G_mid) times exp(G_mid - G_i), each factor within exp(+-limit) while the gates of a
      stay within the limit on either side of its middle (for i <= r the product is exp(G_r - G_i)
      <= 1; above the diagonal it may overflow and is masked out). A sub-chunk past the limit
      ("unsafe") gets its block computed pairwise, exactly.
    - off-diagonal block (a > b): exp(G_r - G_ref(a)) * exp(G_ref(a) - G_end(b)) * exp(G_end(b) - G_i),
      with G_ref(a) the gate just before a: three factors each <= 1, so nothing can overflow and an
      underflow only drops a negligible term.
    """

    def __init__(self, G: torch.Tensor):
        P, C, K = G.shape
        self.C, self.s = C, sub_chunk_size(C)
        s, m = self.s, C // self.s
        self.m = m
        limit, flush = FACTOR_EXP_LIMIT[G.dtype], DECAY_FLUSH[G.dtype]
        G_sub = G.view(P, m, s, K)
        G_end = G_sub[:, :, -1]  # [P, m, K] cumulative gate at the end of each sub-chunk
        G_ref = F.pad(G_end[:, :-1], (0, 0, 1, 0))  # ... just before each sub-chunk
        G_mid = G_sub[:, :, (s - 1) // 2]  # ... and at its middle
        rel = G_sub - G_mid.unsqueeze(2)  # >= 0 before the middle, <= 0 after it
        # safe: every factor around the middle, from the gate before the sub-chunk to its end, is a
        # normal number within exp(+-limit)
        unsafe = torch.maximum(G_ref - G_mid, G_mid - G_end).amax(-1) > limit  # [P, m]
        self.unsafe = unsafe.nonzero(as_tuple=True) if bool(unsafe.any()) else None
        rel = rel.clamp(-limit, limit) if self.unsafe is not None else rel
        self.row = torch.exp(rel)  # exp(G_r - G_mid), clamped if unsafe
        # exp(G_mid - G_i), not 1 / row: the reciprocal's backward multiplies by col^2, up to exp(2 limit),
        # which overflows float32 in training where the forward never does
        self.col = torch.exp(-rel)
        if self.unsafe is not None:
            G_b = G_sub[self.unsafe]  # [nb, s, K]
            self.pair = decay_exp((G_b.unsqueeze(2) - G_b.unsqueeze(1)).clamp(max=0.0))  # [nb, s(r), s(i), K]
            self.to_end = decay_exp(G_end.unsqueeze(2) - G_sub)  # exp(G_end(b) - G_i)
            self.from_ref = decay_exp(G_sub - G_ref.unsqueeze(2))  # exp(G_r - G_ref(a))
        else:
            # products of the factors above while they are exact (rebuilt from row, col and these two small
            # factors where the gate is kept for a backward: `derive`)
            self.flush_below = math.exp(flush)
            self.end_mid = torch.exp(G_end - G_mid).unsqueeze(2)  # [P, m, 1, K]
            self.mid_ref = torch.exp(G_mid - G_ref).unsqueeze(2)
            self.derive()
        self.decay_end = decay_exp(G[:, -1])  # [P, K]
        if m > 1:
            # Gamma = exp(G_r - G_ref(a)) exp(G_ref(a)): each factor is flushed below exp(floor), so a kept
            # product is above exp(2 floor), a normal number
            self.from_start = decay_exp(G_ref).unsqueeze(2)  # [P, m, 1, K]
            self.cross = decay_exp((G_ref.unsqueeze(2) - G_end.unsqueeze(1)).clamp(max=0.0))  # [P, m(a), m(b), K]
            self.end_from_sub = decay_exp(G_end[:, -1:] - G_end).unsqueeze(2)  # exp(G_C - G_end(b)) [P, m, 1, K]

    def derive(self) -> None:
        """to_end = exp(G_end(b) - G_i) and from_ref = exp(G_r - G_ref(a)) of a safe gate, from row and col."""
        self.to_end = F.threshold(self.col * self.end_mid, self.flush_below, 0.0)
        self.from_ref = F.threshold(self.row * self.mid_ref, self.flush_below, 0.0)

    @property
    def derived(self) -> tuple[str, ...]:
        """The factors of the keys' size rebuilt when a kept gate is restored for the backward
        (`restore_derived`): col as 1 / row (both within exp(+-limit), so the reciprocal is a normal
        number; nothing differentiates it there), to_end and from_ref unless a sub-chunk took the exact path."""
        return ("col",) if self.unsafe is not None else ("col", "to_end", "from_ref")

    def restore_derived(self) -> None:
        self.col = torch.reciprocal(self.row)
        if self.unsafe is None:
            self.derive()

    def _sub(self, x):
        return x.view(x.shape[0], self.m, self.s, x.shape[-1])

    def start_factor(self):
        P, m, s, K = self.from_ref.shape
        return (self.from_ref if m == 1 else self.from_ref * self.from_start).view(P, m * s, K)

    def end_factor(self):
        P, m, s, K = self.to_end.shape
        return (self.to_end if m == 1 else self.to_end * self.end_from_sub).view(P, m * s, K)

    def intra(self, q, k):
        """As `NoGate.intra`; the score matrices come as blocks of the sub-chunks, never assembled."""
        P, C, K = q.shape
        m = self.m
        q_sub, k_sub = self._sub(q), self._sub(k)
        # Entries above the diagonal may be inf: tril_ replaces them with 0 (a 0/1 mask would make NaN).
        diag_cols = (k_sub * self.col).transpose(-1, -2)  # [P, m, K, s]
        diag_qk = ((q_sub * self.row) @ diag_cols).tril_()  # [P, m, s, s]
        diag_kk = ((k_sub * self.row) @ diag_cols).tril_(-1)
        if self.unsafe is not None:
            idx = self.unsafe
            k_b = k_sub[idx]
            exact_qk = torch.einsum("brc,bic,bric->bri", q_sub[idx], k_b, self.pair).tril_()
            exact_kk = torch.einsum("brc,bic,bric->bri", k_b, k_b, self.pair).tril_(-1)
            diag_qk, diag_kk = diag_qk.index_put(idx, exact_qk), diag_kk.index_put(idx, exact_kk)
        base = k_sub * self.to_end  # k_i exp(G_end(b) - G_i) <= 1
        q_off, k_off = q_sub * self.from_ref, k_sub * self.from_ref  # x_r exp(G_r - G_ref(a))
        if m == 1:  # G_ref = 0: these are already the rows decayed from the chunk start
            return (
                BlockLower(diag_qk, []),
                BlockLower(diag_kk, []),
                q_off.view(P, C, K),
                k_off.view(P, C, K),
                base.view(P, C, K),
                self.decay_end,
            )
        below_qk, below_kk = [], []
        for a in range(1, m):
            cols = self._cross_cols(base, a).transpose(-1, -2)
            below_qk.append(q_off[:, a] @ cols)
            below_kk.append(k_off[:, a] @ cols)
        return (
            BlockLower(diag_qk, below_qk),
            BlockLower(diag_kk, below_kk),
            (q_off * self.from_start).view(P, C, K),
            (k_off * self.from_start).view(P, C, K),
            (base * self.end_from_sub).view(P, C, K),
            self.decay_end,
        )

    def _cross_cols(self, base, a: int):
        """Rows i of the sub-chunks before a, decayed to the gate before a: base_i exp(G_ref(a) - G_end(b))
        [P, a s, K] (base_i = y_i exp(G_end(b) - G_i))."""
        P, _, s, K = base.shape
        return (base[:, :a] * self.cross[:, a, :a].unsqueeze(2)).reshape(P, a * s, K)

    def lower(self, Ms: list[BlockLower], Y: torch.Tensor) -> list[torch.Tensor]:
        """sum_{i<=r} M_ri Y_ic exp(G_rc - G_ic) for each M of Ms (`BlockLower` [P, C, C]), Y [P, C, K]:
        the Ms share every factor of Y."""
        P, C, K = Y.shape
        m = self.m
        Y_sub = self._sub(Y)
        Y_col = Y_sub * self.col
        cols = []
        if m > 1:
            base = Y_sub * self.to_end
            cols = [self._cross_cols(base, a) for a in range(1, m)]
        outs = []
        for M in Ms:
            out = self.row * (M.diag @ Y_col)  # [P, m, s, K]
            if self.unsafe is not None:
                idx = self.unsafe
                out = out.index_put(idx, torch.einsum("bri,bic,bric->brc", M.diag[idx], Y_sub[idx], self.pair))
            for a, (block, col) in enumerate(zip(M.below, cols), start=1):
                out[:, a].addcmul_(self.from_ref[:, a], block @ col)
            outs.append(out.view(P, C, K))
        return outs

    def upper_sum(self, *pairs: tuple[BlockLower, torch.Tensor]) -> torch.Tensor:
        """sum over (M, X) of sum_{r>=i} M_ri X_rc exp(G_rc - G_ic), each M a `BlockLower` [P, C, C], X
        [P, C, K]: the pairs share every decay factor, so their block products are summed first."""
        P, C, K = pairs[0][1].shape
        s, m = self.s, self.m
        subs = [self._sub(X) for _, X in pairs]
        out = None
        for (M, _), X_sub in zip(pairs, subs):
            term = M.diag.transpose(-1, -2) @ (X_sub * self.row)
            out = term if out is None else out.add_(term)
        out.mul_(self.col)
        if self.unsafe is not None:
            idx = self.unsafe
            out = out.index_put(
                idx,
                _sum(
                    torch.einsum("bri,brc,bric->bic", M.diag[idx], X_sub[idx], self.pair)
                    for (M, _), X_sub in zip(pairs, subs)
                ),
            )
        if m > 1:
            X_off = [X_sub[:, 1:] * self.from_ref[:, 1:] for X_sub in subs]  # x_r exp(G_r - G_ref(a)), a >= 1
            below = torch.zeros_like(out[:, :-1])
            for a in range(1, m):
                # row block a reaches the sub-chunks before it through exp(G_ref(a) - G_end(b))
                reached = None
                for (M, _), x in zip(pairs, X_off):
                    term = M.below[a - 1].transpose(-1, -2) @ x[:, a - 1]
                    reached = term if reached is None else reached.add_(term)
                below[:, :a].addcmul_(reached.view(P, a, s, K), self.cross[:, a, :a].unsqueeze(2))
            out[:, :-1].addcmul_(below, self.to_end[:, :-1])
        return out.view(P, C, K)

    def channel_sum(self, x):
        return x
