"""What `k3 lab prefill` measures: the sweep of each mode, the best-of-rounds time of every (op, T, C),
and the breakdown of one call by aten op (`OpLedger`).

Inputs are those `k3 bench ops` times (`k3.bench.ops.kda_inputs`: seed 0, KDA's safe gate); timing is
`k3.bench.timing.interleaved_best` as `k3 bench ops` uses it, in inference mode, on the default thread
count."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ...bench.ops import GATE_LOWER_BOUND, kda_inputs
from ...bench.timing import interleaved_best
from ...ops import chunk_kda, chunk_linear_attn
from ...ops.cost import OPS, k3_cost
from .ledger import MATMULS, OpLedger

FULL = "T"  # the key of the C = T (fully parallel) column
# the inputs' gate (`kda_inputs`: Kimi K3's safe gate) is bounded below by GATE_LOWER_BOUND, which
# chunk_kda is told as the model tells it (`lower_bound`): the count and the timings are of that op
KDA_LOWER_BOUND = GATE_LOWER_BOUND


def op_cost(op: str, T: int, d: int, C: int) -> float:
    """k3_cost of `op` as this experiment runs it (KDA with the safe gate's stated bound)."""
    return k3_cost(op, T, d, C, lower_bound=KDA_LOWER_BOUND if op == "kda" else None)


@dataclass(frozen=True)
class Sweep:
    """What one mode measures: sequence lengths, chunk sizes, the head shape and the timing rounds.
    `full_cap[op]` is the largest T at which C = T is run (its memory grows as T², KDA's time as T³)."""

    lengths: tuple[int, ...]
    chunks: tuple[int, ...]
    heads: int
    dim: int
    rounds: int  # timing rounds of the chunked cases
    full_rounds: int  # ... and of the C = T cases, which take seconds each
    full_cap: dict
    breakdown_tokens: int  # T at which the time of one call is broken down by op


SWEEPS = {
    "smoke": Sweep(
        (64, 128),
        (16, 32),
        heads=2,
        dim=16,
        rounds=1,
        full_rounds=1,
        full_cap={"linear_attn": 128, "kda": 128},
        breakdown_tokens=256,
    ),
    "quick": Sweep(
        (1024, 2048, 4096, 8192, 16384),
        (16, 32, 64, 128),
        heads=8,
        dim=64,
        rounds=5,
        full_rounds=2,
        full_cap={"linear_attn": 4096, "kda": 2048},
        breakdown_tokens=4096,
    ),
    "full": Sweep(
        (1024, 2048, 4096, 8192, 16384),
        (16, 32, 64, 128),
        heads=8,
        dim=64,
        rounds=9,
        full_rounds=3,
        full_cap={"linear_attn": 8192, "kda": 4096},
        breakdown_tokens=4096,
    ),
}


def _op_call(op: str, inputs: tuple, C: int):
    q, k, v, g, beta = inputs
    if op == "linear_attn":
        return lambda: chunk_linear_attn(q, k, v, chunk_size=C)
    return lambda: chunk_kda(q, k, v, g, beta, chunk_size=C, lower_bound=KDA_LOWER_BOUND)


def measure_times(sweep: Sweep) -> dict[tuple[str, int, int | str], float]:
    """Best-of-rounds seconds for every (op, T, C), C = "T" for the one-chunk form. The chunked cases of
    one T are interleaved round by round; the one-chunk cases (seconds each) get fewer rounds of their
    own and no warm-up call."""
    times: dict[tuple[str, int, int | str], float] = {}
    for T in sweep.lengths:
        inputs = kda_inputs(T, sweep.heads, sweep.dim)
        chunked = {(op, T, C): _op_call(op, inputs, C) for op in OPS for C in sweep.chunks if C < T}
        full = {(op, T, FULL): _op_call(op, inputs, T) for op in OPS if T <= sweep.full_cap[op]}
        with torch.inference_mode():
            times.update(interleaved_best(chunked, sweep.rounds))
            times.update(interleaved_best(full, sweep.full_rounds, cold=frozenset(full)))
    return times


def time_breakdown(sweep: Sweep) -> list[dict]:
    """Where the time of one call goes, per op and C at T = sweep.breakdown_tokens (best of two
    instrumented calls after a warm-up): matmuls and triangular solves (the work the cost models
    count), the other aten ops (elementwise decay factors, masks, copies, cumulative sums) and what
    runs outside any op (Python and dispatch between ops)."""
    T = sweep.breakdown_tokens
    inputs = kda_inputs(T, sweep.heads, sweep.dim)
    rows = []
    for op in OPS:
        for C in sweep.chunks:
            call = _op_call(op, inputs, min(C, T))
            best = None
            # without gradients the op runs in inference mode, where `matmul` reaches the ledger whole
            # (the ledger counts it from its shapes)
            with torch.no_grad():
                call()
                for _ in range(2):
                    with OpLedger() as ledger:
                        start = time.perf_counter()
                        call()
                        wall = time.perf_counter() - start
                    if best is None or wall < best[0]:
                        best = (wall, ledger)
            wall, ledger = best
            matmul = sum(ledger.seconds[name] for name in MATMULS)
            others = {name: t for name, t in ledger.seconds.items() if name not in MATMULS}
            top = max(others, key=others.get)
            rows.append(
                {
                    "op": op,
                    "C": C,
                    "wall": wall,
                    "matmul": matmul,
                    "macs": ledger.macs,
                    "other": sum(others.values()),
                    "top": top,
                    "top_s": others[top],
                    "cumsum": ledger.seconds["cumsum"],
                    "outside": max(0.0, wall - matmul - sum(others.values())),
                }
            )
    return rows
