"""`OpLedger`: every aten op of a call timed, and the multiply-adds of its matmuls and triangular solves
counted from their shapes. `k3 lab prefill` uses it to show where one call's time goes (much of it in
work with no multiply-adds at all), and a test checks `k3_cost` against the counts."""

from __future__ import annotations

import math
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

MATMULS = (
    "bmm",
    "baddbmm",
    "baddbmm_",
    "mm",
    "addmm",
    "addmm_",
    "mv",
    "addmv",
    "dot",
    "matmul",
    "linalg_solve_triangular",
)


class OpLedger(TorchDispatchMode):
    """Inside `with OpLedger() as ledger:` every aten op is timed (`ledger.seconds[name]`) and the
    multiply-adds of the matmuls and triangular solves are counted (`ledger.macs`): a solve of
    A X = B (or X A = B) with A [..., s, s] costs s(s - 1)/2 per row or column of B."""

    def __init__(self):
        super().__init__()
        self.seconds: Counter = Counter()
        self.macs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.seconds[name] += time.perf_counter() - start
        if name in MATMULS:
            self.macs += _macs(name, args)
        elif name in ("einsum", "linear", "addbmm"):
            raise RuntimeError(
                f"OpLedger: {name} reached the ledger undecomposed; its multiply-adds would go uncounted"
            )
        return out


def _macs(name: str, args: tuple) -> int:
    """Multiply-adds of one matmul-family aten op from its arguments."""
    if name == "matmul":  # seen whole in inference mode (under autograd it arrives as bmm / mm)
        a, b = args[:2]
        n, k = (1, a.shape[0]) if a.dim() == 1 else a.shape[-2:]
        m = 1 if b.dim() == 1 else b.shape[-1]
        batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2] if b.dim() > 1 else ())
        return math.prod(batch) * n * k * m
    if name == "linalg_solve_triangular":  # A [..., s, s], B: s(s - 1)/2 per row or column of B
        s = args[0].shape[-1]
        return args[1].numel() // s * s * (s - 1) // 2
    a, b = args[:2] if name in ("bmm", "mm", "mv", "dot") else args[1:3]  # the add* ops: (input, a, b)
    if name in ("mv", "addmv", "dot"):
        return a.numel()
    return a.numel() * b.shape[-1]
