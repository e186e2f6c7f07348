"""The UT (WY) transform: applying T = (I + A)^-1 for a strictly lower-triangular A, block by block.

Inside a chunk of C tokens the delta rule's corrections U solve the unit-lower-triangular system
(I + A) U = X, so U = T X with T = (I + A)^-1 (see `k3.ops.chunk`). A lower-triangular [P, C, C]
matrix is kept as blocks of s rows and columns (C = m s, `BlockLower`), and T is built by block rows:

    T_aa   = (I + A_aa)^-1                          one batched triangular solve over all a
    T_a,<a = -T_aa A_a,<a T_<a,<a                   each block row from the rows above it
    (T X)_a = T_a,<a X_<a + T_aa X_a

Tiny entries of these dimensionless blocks are flushed to zero between the stages, before they can
turn subnormal (see `k3.ops.numerics`); one triangular solve over all C rows would leave no point
between stages to flush them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .numerics import flush_tiny


class BlockLower(NamedTuple):
    """A lower-triangular [P, C, C] matrix kept as blocks of s rows and columns (C = m s): the
    diagonal blocks diag [P, m, s, s] and, for each row block a >= 1, the part left of its diagonal
    block below[a - 1] [P, s, a s]. Above the diagonal blocks it is zero, and never stored."""

    diag: torch.Tensor
    below: list[torch.Tensor]

    @staticmethod
    def split(A: torch.Tensor, s: int) -> "BlockLower":
        """The blocks of A [P, C, C] (views, nothing copied)."""
        P, C, _ = A.shape
        m = C // s
        diag = A.view(P, m, s, m, s).diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2)
        return BlockLower(diag, [A[:, a * s : (a + 1) * s, : a * s] for a in range(1, m)])

    def scale_rows(self, x: torch.Tensor) -> "BlockLower":
        """Diag(x) L for x [P, C, 1]."""
        P, m, s, _ = self.diag.shape
        x = x.view(P, m, s, 1)
        return BlockLower(self.diag * x, [b * x[:, a] for a, b in enumerate(self.below, start=1)])

    def addmm_(self, out: torch.Tensor, X: torch.Tensor, beta: float = 1.0, alpha: float = 1.0) -> torch.Tensor:
        """out <- beta out + alpha L X, in place; X, out [P, C, d]."""
        P, m, s, _ = self.diag.shape
        d = X.shape[-1]
        out.view(P * m, s, d).baddbmm_(self.diag.reshape(P * m, s, s), X.reshape(P * m, s, d), beta=beta, alpha=alpha)
        for a, block in enumerate(self.below, start=1):
            # into a fresh product first: baddbmm_ into a strided row slice is slow on CPU
            out[:, a * s : (a + 1) * s].add_(block @ X[:, : a * s], alpha=alpha)
        return out

    def unit_inverse(self) -> "BlockLower":
        """T = (I + L)^-1 for this strictly lower L (the UT transform), as blocks, by the block-row
        recursion of the module docstring."""
        P, m, s, _ = self.diag.shape
        eye = torch.eye(s, dtype=self.diag.dtype, device=self.diag.device).expand(P, m, s, s)
        # X (I + L_aa) = I gives the same inverse as (I + L_aa) X = I; on CPU the right-hand solve on a
        # contiguous copy is the faster of the two
        inv = flush_tiny(
            torch.linalg.solve_triangular(
                flush_tiny(self.diag.contiguous()), eye, upper=False, left=False, unitriangular=True
            )
        )
        lefts: list[torch.Tensor] = []  # T_a,<a for a >= 1
        for a, block in enumerate(self.below, start=1):
            above = (
                inv[:, 0]
                if a == 1
                else _stack_rows(
                    [inv[:, 0]] + [torch.cat([left, inv[:, i]], dim=-1) for i, left in enumerate(lefts, start=1)], a * s
                )
            )
            lefts.append(flush_tiny(-inv[:, a] @ (flush_tiny(block) @ above)))
        return BlockLower(inv, lefts)

    def scale_columns(self, x: torch.Tensor) -> "BlockLower":
        """L Diag(x) for x [P, C, 1]."""
        P, m, s, _ = self.diag.shape
        return BlockLower(
            self.diag * x.view(P, m, s, 1).transpose(-1, -2),
            [b * x[:, : a * s].transpose(-1, -2) for a, b in enumerate(self.below, start=1)],
        )

    def matmul(self, *rhs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """L X for each X [P, C, d] of `rhs`, block row by block row."""
        P, m, s, _ = self.diag.shape
        results = []
        for X in rhs:
            parts = X.split(s, dim=1)
            out = [self.diag[:, 0] @ parts[0]]
            out += [
                torch.baddbmm(self.diag[:, a] @ parts[a], left, X[:, : a * s])
                for a, left in enumerate(self.below, start=1)
            ]
            results.append(out[0] if m == 1 else torch.cat(out, dim=1))
        return tuple(results)

    def t_matmul(self, *rhs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """L^T X for each X [P, C, d] of `rhs`, block column by block column."""
        P, m, s, _ = self.diag.shape
        results = []
        for X in rhs:
            d = X.shape[-1]
            out = self.diag.transpose(-1, -2) @ X.view(P, m, s, d)  # [P, m, s, d]
            for a, block in enumerate(self.below, start=1):
                out[:, :a] += (block.transpose(-1, -2) @ X[:, a * s : (a + 1) * s]).view(P, a, s, d)
            results.append(out.view(P, m * s, d))
        return tuple(results)

    @staticmethod
    def outer(A: torch.Tensor, B: torch.Tensor, s: int, strict: bool = False) -> "BlockLower":
        """The lower triangle of A B^T (A, B [P, C, d]; without the diagonal if `strict`), as blocks of s
        rows and columns."""
        P, C, d = A.shape
        m = C // s
        diag = (A.view(P * m, s, d) @ B.view(P * m, s, d).transpose(-1, -2)).view(P, m, s, s).tril_(-1 if strict else 0)
        below = [A[:, a * s : (a + 1) * s] @ B[:, : a * s].transpose(-1, -2) for a in range(1, m)]
        return BlockLower(diag, below)

    def mul(self, other: "BlockLower") -> "BlockLower":
        """The elementwise product with another lower matrix of the same blocks."""
        return BlockLower(self.diag * other.diag, [a * b for a, b in zip(self.below, other.below)])


def _stack_rows(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """Row blocks of growing width, zero-padded on the right to `width` and stacked."""
    return torch.cat([F.pad(r, (0, width - r.shape[-1])) for r in rows], dim=1)
