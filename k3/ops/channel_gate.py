"""KDA's per-channel gate: decays exp(G_rc - G_ic) of one chunk factored around sub-chunks and blocks.

`ChannelGate` is the per-channel implementation of the gate interface of `k3.ops.gates` (the scores of a
chunk, the decayed rows, and the two applies the backward needs), for G [P, C, K]. It never forms the
[C, C, K] decays: each is a product of factors around a gate between i and r, so that every sum is a
matmul of decayed rows and decayed columns (see the class).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .numerics import DECAY_FLUSH, FACTOR_EXP_LIMIT, decay_exp
from .ut import BlockLower

MAX_SUB_CHUNK = 32  # most tokens per sub-chunk: the diagonal blocks of the score matrices and of the UT transform


def sub_chunk_size(C: int) -> int:
    """The size s of the sub-chunks a chunk of C tokens is split into: the largest divisor of C up to
    MAX_SUB_CHUNK."""
    return max(s for s in range(1, min(MAX_SUB_CHUNK, C) + 1) if C % s == 0)


def _sum(terms):
    """The sum of an iterable of tensors, accumulated in place into the first."""
    total = None
    for term in terms:
        total = term if total is None else total.add_(term)
    return total


class ChannelGate:
    """KDA: one decay per key channel, G [P, C, K], factored around sub-chunks a, b of s <= 32 tokens.

    Decay r,i (r in sub-chunk a, i in b, i <= r) for channel c:
    - off-diagonal block (a > b): exp(G_r - G_ref(a)) * exp(G_ref(a) - G_end(b)) * exp(G_end(b) - G_i),
      with G_ref(a) the gate just before a and G_end(b) the gate at b's end: three factors each <= 1.
    - diagonal block (a = b), by halves: the block (padded to S, the next power of two, with rows of
      zeros whose gate repeats the sub-chunk's last) is split in two; its lower-left quadrant (r in the
      second half, i in the first) is

          exp(G_r - G_p) * exp(G_p - G_i),     p the last position of the first half (i <= p < r),

      one matmul of rows x_r exp(G_r - G_p) and columns y_i exp(G_p - G_i); the two diagonal quadrants
      are split the same way. Level j (blocks of S / 2^j tokens, all sub-chunks and blocks in one
      batched matmul) gives each position one factor around its block's p: `cols[j]` exp(G_p - G_i)
      over the first halves, `rows[j]` exp(G_r - G_p) over the second. Every pair i < r is in exactly
      one quadrant, at the level where r and i part. These factors are <= 1 (G never increases), so
      none can overflow whatever the gates are: no range to check, no branch on the data.
    - the blocks left after `levels` halvings, of b tokens: every pair at once around the block's p,
      rows x_r exp(G_r - G_p) and columns y_i exp(G_p - G_i) (`row`, `col`), masked to i <= r. A factor
      may now exceed 1: with every step's g >= lower_bound (a bound the caller states: Kimi K3's safe
      gate, -5) each is within exp(+-(b/2)|lower_bound|), and the halving stops at the largest b that
      keeps this within FACTOR_EXP_LIMIT, where both factors and their products are normal numbers.
      Without a bound it goes down to single tokens (b = 1: r = i, factor 1).

    A factor <= 1 below exp(floor) is flushed to 0 (`decay_exp`), and then the product it belongs to,
    the decay it stands for, is below exp(floor) too, negligible (`k3.ops.numerics`); kept factors are
    at least exp(floor), so their products are normal numbers.
    """

    derived = ("rows", "cols", "col", "to_end", "from_ref")  # rebuilt from G and row when a kept gate is restored

    def __init__(self, G: torch.Tensor, lower_bound: float | None = None):
        P, C, K = G.shape
        self.C, self.s = C, sub_chunk_size(C)
        self.m = C // self.s
        self.S = 1 << (self.s - 1).bit_length()  # the sub-chunk padded to a power of two
        self.levels = halving_levels(self.S, lower_bound, G.dtype)
        self.b = self.S >> self.levels  # the blocks factored whole
        self.G = G.view(P, self.m, self.s, K)  # the backward keeps the slab's G anyway: the gate adds nothing
        self.decay_end = decay_exp(G[:, -1])  # [P, K]
        if self.m > 1:
            G_end, G_ref = self._ends()
            # Gamma = exp(G_r - G_ref(a)) exp(G_ref(a)): each factor is flushed below exp(floor), so a kept
            # product is above exp(2 floor), a normal number
            self.from_start = decay_exp(G_ref).unsqueeze(2)  # [P, m, 1, K]
            self.cross = decay_exp((G_ref.unsqueeze(2) - G_end.unsqueeze(1)).clamp(max=0.0))  # [P, m(a), m(b), K]
            self.end_from_sub = decay_exp(G_end[:, -1:] - G_end).unsqueeze(2)  # exp(G_C - G_end(b)) [P, m, 1, K]
        self.row = None
        self.restore_derived()

    def _ends(self):
        """The gate at the end of each sub-chunk and just before it (0 before the first) [P, m, K]."""
        G_end = self.G[:, :, -1]
        return G_end, F.pad(G_end[:, :-1], (0, 0, 1, 0))

    def restore_derived(self) -> None:
        """The factors of the keys' size: exp(G_end(b) - G_i), exp(G_r - G_ref(a)), the levels' and the
        whole blocks'."""
        G_end, G_ref = self._ends()
        P, m, s, K = self.G.shape
        G = self._pad(self.G, G_end.unsqueeze(2).expand(P, m, self.S - s, K))
        if self.b == 1:  # every factor from its own exponent
            self.col = None
            self.to_end = decay_exp(G_end.unsqueeze(2) - self.G)  # [P, m, s, K]
            self.from_ref = decay_exp(self.G - G_ref.unsqueeze(2))
            self.cols, self.rows = [], []  # [P, m, n, h, K] each
            for j in range(self.levels):
                first, second = self._halves(G, j).unbind(3)
                G_p = first[:, :, :, -1:]  # the gate at the end of each first half
                self.cols.append(decay_exp(G_p - first))
                self.rows.append(decay_exp(second - G_p))
            return
        # One exp of the keys' size (kept for the backward): row = exp(G_r - G_t) around each whole
        # block's middle t (within exp(+-limit), exact: not flushed) and col = 1 / row. Every other
        # factor is one of them times a factor <= 1 between the middles and the gates it reaches, of one
        # value per block: exp(G_r - G_x) = row_r exp(G_t - G_x). Where that product is at least
        # exp(floor), the block's factor is at least exp(floor - limit), a normal number kept exactly;
        # below, it is flushed.
        blocks = self._blocks(G)
        G_t = blocks[:, :, :, self.b // 2 - 1]  # [P, m, n, K]
        if self.row is None:
            self.row = torch.exp(blocks - G_t.unsqueeze(3))  # [P, m, n, b, K]
        self.col = torch.reciprocal(self.row)
        whole = lambda x: self._unpad(x.view(P, m, self.S, K))  # noqa: E731
        self.from_ref = whole(self._times_block(self.row, G_t - G_ref.unsqueeze(2)))
        self.to_end = whole(self._times_block(self.col, G_end.unsqueeze(2) - G_t))
        self.cols, self.rows = [], []
        n = 1 << self.levels
        for j in range(self.levels):
            split = lambda x: x.view(P, m, 1 << j, 2, n >> (j + 1), *x.shape[3:]).unbind(3)  # noqa: E731
            G_p = self._halves(G, j)[:, :, :, 0, -1].unsqueeze(3)  # the end of each first half [P, m, 2^j, 1, K]
            (t_first, t_second), (col, _), (_, row) = split(G_t), split(self.col), split(self.row)
            h = self.S >> (j + 1)
            self.cols.append(self._times_block(col, G_p - t_first).view(P, m, 1 << j, h, K))
            self.rows.append(self._times_block(row, t_second - G_p).view(P, m, 1 << j, h, K))

    def _times_block(self, factor, exponent):
        """factor [..., b, K] (a whole block's row or col) times exp(exponent) [..., K] (<= 0, one per
        block), flushed below exp(floor): a decay factor <= 1 (see `restore_derived`)."""
        floor = DECAY_FLUSH[factor.dtype]
        block = decay_exp(exponent, floor - FACTOR_EXP_LIMIT[factor.dtype]).unsqueeze(-2)
        return F.threshold(factor * block, math.exp(floor), 0.0)

    def _pad(self, x, fill=None):
        """x [P, m, s, d] padded to S rows per sub-chunk (with zeros, or `fill`)."""
        if self.S == self.s:
            return x
        return F.pad(x, (0, 0, 0, self.S - self.s)) if fill is None else torch.cat([x, fill], dim=2)

    def _pad_block(self, D):
        """A diagonal block D [P, m, s, s] padded with zeros to S x S."""
        return D if self.S == self.s else F.pad(D, (0, self.S - self.s, 0, self.S - self.s))

    def _unpad(self, x):
        return x if self.S == self.s else x[:, :, : self.s]

    def _halves(self, x, j: int):
        """x [P, m, S, d] as level j's blocks, [P, m, n, 2, h, d] (n = 2^j blocks of two halves of h)."""
        P, m, S, d = x.shape
        return x.view(P, m, 1 << j, 2, S >> (j + 1), d)

    def _blocks(self, x):
        """x [P, m, S, d] as the blocks factored whole, [P, m, n, b, d] (n = 2^levels blocks of b)."""
        P, m, S, d = x.shape
        return x.view(P, m, 1 << self.levels, self.b, d)

    def _sub(self, x):
        return x.view(x.shape[0], self.m, self.s, x.shape[-1])

    def start_factor(self):
        P, m, s, K = self.from_ref.shape
        return (self.from_ref if m == 1 else self.from_ref * self.from_start).view(P, m * s, K)

    def end_factor(self):
        P, m, s, K = self.to_end.shape
        return (self.to_end if m == 1 else self.to_end * self.end_from_sub).view(P, m * s, K)

    def _diag_scores(self, q_sub, k_sub):
        """The diagonal blocks of A_qk (incl.) and A_kk (strict) [P, m, s, s]: the whole blocks, then the
        quadrants level by level."""
        P, m, _, K = q_sub.shape
        q, k = self._pad(q_sub), self._pad(k_sub)
        if self.b > 1:  # the whole blocks; entries above the diagonal may be inf: tril_ replaces them with 0
            cols = (self._blocks(k) * self.col).transpose(-1, -2)  # (a 0/1 mask would make NaN)
            whole_qk = ((self._blocks(q) * self.row) @ cols).tril_()
            whole_kk = ((self._blocks(k) * self.row) @ cols).tril_(-1)
        if self.levels == 0 and self.b > 1:  # no halving: the whole blocks are the sub-chunks
            qk, kk = whole_qk.view(P, m, self.S, self.S), whole_kk.view(P, m, self.S, self.S)
        else:
            qk, kk = q.new_zeros(P, m, self.S, self.S), q.new_zeros(P, m, self.S, self.S)
            if self.b == 1:
                qk.diagonal(dim1=-2, dim2=-1).copy_((q * k).sum(-1))
            else:
                _diagonal_blocks(qk, self.levels).copy_(whole_qk)
                _diagonal_blocks(kk, self.levels).copy_(whole_kk)
            for j in range(self.levels):
                cols = self._halves(k, j)[:, :, :, 0] * self.cols[j]  # k_i exp(G_p - G_i) [P, m, n, h, K]
                for x, out in ((q, qk), (k, kk)):
                    rows = self._halves(x, j)[:, :, :, 1] * self.rows[j]  # x_r exp(G_r - G_p)
                    if cols.shape[-2] == 1:  # 1 x 1 quadrants: a product summed, not a batch of tiny matmuls
                        _quadrants(out, j).copy_((rows * cols).sum(-1, keepdim=True))
                    else:
                        _quadrants(out, j).copy_(rows @ cols.transpose(-1, -2))
        if self.S == self.s:
            return qk, kk
        return qk[..., : self.s, : self.s].contiguous(), kk[..., : self.s, : self.s].contiguous()

    def _whole_lower(self, D, Y_pad):
        """The whole blocks' part of `lower`: sum_{i<=r in r's block} D_ri Y_i exp(G_r - G_i) [P, m, S, d]."""
        if self.b == 1:
            return D.diagonal(dim1=-2, dim2=-1).unsqueeze(-1) * Y_pad
        reached = _diagonal_blocks(D, self.levels) @ (self._blocks(Y_pad) * self.col)
        return (self.row * reached).view(Y_pad.shape)

    def _whole_upper(self, D, X_pad):
        """One pair's whole-block part of `upper_sum`, without the columns' factor exp(G_p - G_i) (applied
        once to the pairs' sum): sum_{r>=i in i's block} D_ri X_r exp(G_r - G_p) [P, m, n, b, d]."""
        if self.b == 1:
            return (D.diagonal(dim1=-2, dim2=-1).unsqueeze(-1) * X_pad).view(self._blocks(X_pad).shape)
        return _diagonal_blocks(D, self.levels).transpose(-1, -2) @ (self._blocks(X_pad) * self.row)

    def intra(self, q, k):
        """As `NoGate.intra`; the score matrices come as blocks of the sub-chunks, never assembled."""
        P, C, K = q.shape
        m = self.m
        q_sub, k_sub = self._sub(q), self._sub(k)
        diag_qk, diag_kk = self._diag_scores(q_sub, k_sub)
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
        Y_pad = self._pad(Y_sub)
        diags = [self._pad_block(M.diag) for M in Ms]
        outs = [self._whole_lower(D, Y_pad) for D in diags]
        for j in range(self.levels):
            cols = self._halves(Y_pad, j)[:, :, :, 0] * self.cols[j]  # Y_i exp(G_p - G_i)
            for D, out in zip(diags, outs):
                quad = _quadrants(D, j)
                reached = quad * cols if cols.shape[-2] == 1 else quad @ cols
                self._halves(out, j)[:, :, :, 1].addcmul_(self.rows[j], reached)  # times exp(G_r - G_p)
        outs = [self._unpad(out) for out in outs]
        if m > 1:
            base = Y_sub * self.to_end
            cols = [self._cross_cols(base, a) for a in range(1, m)]
            for M, out in zip(Ms, outs):
                for a, (block, col) in enumerate(zip(M.below, cols), start=1):
                    out[:, a].addcmul_(self.from_ref[:, a], block @ col)
        return [out.reshape(P, C, K) for out in outs]

    def upper_sum(self, *pairs: tuple[BlockLower, torch.Tensor]) -> torch.Tensor:
        """sum over (M, X) of sum_{r>=i} M_ri X_rc exp(G_rc - G_ic), each M a `BlockLower` [P, C, C], X
        [P, C, K]: the pairs share every decay factor, so their block products are summed first."""
        P, C, K = pairs[0][1].shape
        s, m = self.s, self.m
        subs = [self._sub(X) for _, X in pairs]
        pads = [self._pad(X_sub) for X_sub in subs]
        diags = [self._pad_block(M.diag) for M, _ in pairs]
        out = _sum(self._whole_upper(D, X) for D, X in zip(diags, pads))
        out = (out if self.b == 1 else out * self.col).view(pads[0].shape)
        for j in range(self.levels):
            reached = None
            for D, X in zip(diags, pads):
                rows = self._halves(X, j)[:, :, :, 1] * self.rows[j]  # X_r exp(G_r - G_p)
                quad = _quadrants(D, j).transpose(-1, -2)
                term = quad * rows if rows.shape[-2] == 1 else quad @ rows
                reached = term if reached is None else reached.add_(term)
            self._halves(out, j)[:, :, :, 0].addcmul_(self.cols[j], reached)  # times exp(G_p - G_i)
        out = self._unpad(out)
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
        return out.reshape(P, C, K)

    def channel_sum(self, x):
        return x


def halving_levels(S: int, lower_bound: float | None, dtype: torch.dtype) -> int:
    """How many times `ChannelGate` halves a padded sub-chunk of S tokens: until each block's factors
    around its middle, within exp(+-(b/2)|lower_bound|), are within FACTOR_EXP_LIMIT; down to single
    tokens (log2 S) without a bound."""
    b = S
    if lower_bound is not None:
        while b > 1 and b // 2 * -lower_bound > FACTOR_EXP_LIMIT[dtype]:
            b //= 2
    else:
        b = 1
    return (S // b).bit_length() - 1


def _diagonal_blocks(D: torch.Tensor, j: int) -> torch.Tensor:
    """Level j's diagonal blocks of D [P, m, S, S] (n = 2^j blocks of b = S / 2^j): a view [P, m, n, b, b]."""
    P, m, S, _ = D.shape
    n = 1 << j
    b = S // n
    return D.view(P, m, n, b, n, b).diagonal(dim1=2, dim2=4).movedim(-1, 2)


def _quadrants(D: torch.Tensor, j: int) -> torch.Tensor:
    """The lower-left quadrants of level j's diagonal blocks of D [P, m, S, S] (rows in the second half of
    a block of b = S / 2^j, columns in its first): a view [P, m, n, h, h], n = 2^j, h = b / 2."""
    h = D.shape[-1] >> (j + 1)
    return _diagonal_blocks(D, j)[:, :, :, h:, :h]
