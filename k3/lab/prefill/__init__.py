"""`k3 lab prefill`: chunkwise prefill time against the article's cost model 2·L·d² + 2·L·C·d.

The article counts the chunked form per head, in multiply-adds: across chunks the state work, Q_i S and
K_iᵀ V_i, C·d² each per chunk, 2·L·d² in all whatever C is; inside chunks the masked score matrices,
Q_i K_iᵀ and (·)V_i, C²·d each, 2·L·C·d in all. "So the smaller I make C, the fewer FLOPs I do"; C = L
is full attention (2·L²·d) and C = 1 the plain recurrence, "the cheapest option in pure FLOP terms, but
not necessarily in wall-clock time" (GPUs want C = 64 or 128).

This experiment times k3's chunk ops against that model on the CPU, for C in {16, 32, 64, 128} and
C = T (the fully parallel form), T up to 16,384:

- `chunk_linear_attn` is the form the article derives the model for, and computes exactly its terms
  (plus the normaliser column: V + 1 values).
- `chunk_kda` adds the delta rule's UT transform inside each chunk: two more score-like products
  (A_kk and the corrections W, U), a state step more, and the inverse (I + A)⁻¹ of a C x C
  triangular matrix, about C³/3 multiply-adds per chunk, here with Kimi K3's safe gate and its stated
  bound (`lower_bound=-5`, as the model passes it). `k3_cost` counts what it runs exactly (a test
  checks the count against every matmul and triangular solve the op dispatches): in the chunked
  regime (C ≤ 128 at d = 64) that is 1.7-1.8x the article's count, nearly a constant, but at C = T
  the inverse makes the "full attention" end cubic in T, not quadratic.

One constant (seconds per multiply-add) is fitted per model on the chunked points, in relative terms,
and the prediction is compared with every point, the C = T ones included (out of the fit). A breakdown
of one call by aten op (`OpLedger`) shows why one constant cannot fit all C: much of the time is in
work that has no multiply-adds at all.

The two cost models are k3's ops' own (`k3.ops.cost`: the capacity planner prices the linear family
with the same count). The package: `fits` (the fits), `measure` (the sweeps and the timings),
`ledger` (`OpLedger`, the per-op breakdown's instrument), `report` (claims, tables, notes, figures);
here `run` and `analyse`, which fits the models to the times.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from ...bench.timing import matmul_gflops
from ...ops.cost import OPS, article_cost
from ..report import Result, command
from . import report
from .fits import error_factor, fit_scale, loglog_slope
from .measure import FULL, SWEEPS, Sweep, measure_times, op_cost, time_breakdown


def run(mode: str, docs: Path, **options) -> Result:
    if options:
        raise ValueError(f"k3 lab prefill takes no options, got {sorted(options)}")
    sweep = SWEEPS[mode]
    d, H = sweep.dim, sweep.heads
    times = measure_times(sweep)
    gemm = matmul_gflops(n=256 if mode == "smoke" else 1024)
    breakdown = time_breakdown(sweep)
    analysis, model_best = analyse(sweep, times)

    setup = {
        "shape": f"B = 1, H = {H}, K = V = d = {d}, float32, inputs as k3 bench ops (seed 0; KDA gate "
        "g = -5 sigmoid(x))",
        "lengths": list(sweep.lengths),
        "chunk_sizes": list(sweep.chunks),
        "C = T up to": sweep.full_cap,
        "timing": f"best of {sweep.rounds} interleaved rounds per T ({sweep.full_rounds} for C = T)",
        "threads": torch.get_num_threads(),
        "gemm_gflops": round(gemm, 1),
    }
    return Result(
        name="prefill",
        title="Prefill cost: the chunk size against the FLOP model",
        mode=mode,
        command=command("prefill", mode),
        claims=report.claims(sweep, analysis, model_best),
        tables=report.tables(sweep, times, analysis, breakdown, gemm),
        figures=report.figures(docs, sweep, times, analysis),
        notes=report.notes(sweep, analysis, breakdown, gemm, model_best),
        setup=setup,
    )


def analyse(sweep: Sweep, times: dict) -> tuple[dict, int]:
    """Fits: one constant per (op, cost model) on the chunked points, how far its predictions fall from
    every point (the C = T ones out of the fit), the log-log slopes against T and the fastest C at the
    longest T; and the C the article's model finds cheapest there."""
    T_max, d = max(sweep.lengths), sweep.dim
    models = {"article": lambda op, T, C: article_cost(T, d, C), "k3 count": lambda op, T, C: op_cost(op, T, d, C)}
    analysis = {}
    for op in OPS:
        points = [(T, C, t) for (o, T, C), t in times.items() if o == op]
        chunked = [(T, C, t) for T, C, t in points if C != FULL]
        full = [(T, T, t) for T, C, t in points if C == FULL]
        per_model = {}
        for name, cost in models.items():
            scale = fit_scale([cost(op, T, C) for T, C, _ in chunked], [t for *_, t in chunked])
            factors = [error_factor(scale * cost(op, T, C), t) for T, C, t in chunked]
            full_factors = [error_factor(scale * cost(op, T, C), t) for T, C, t in full]
            per_model[name] = {
                "scale": scale,
                "median": statistics.median(factors),
                "worst": max(factors),
                "full_worst": max(full_factors) if full_factors else None,
            }
        at_max = {C: times[(op, T_max, C)] for C in sweep.chunks if (op, T_max, C) in times}
        slopes = {
            C: loglog_slope(
                [T for T in sweep.lengths if (op, T, C) in times],
                [times[(op, T, C)] for T in sweep.lengths if (op, T, C) in times],
            )
            for C in sweep.chunks
            if sum((op, T, C) in times for T in sweep.lengths) >= 2
        }
        full_slope = loglog_slope([T for T, _, _ in full], [t for *_, t in full]) if len(full) >= 2 else None
        analysis[op] = {
            "models": per_model,
            "at_max": at_max,
            "best_C": min(at_max, key=at_max.get),
            "slopes": slopes,
            "full_slope": full_slope,
            "full": full,
        }
    model_best = min(sweep.chunks, key=lambda C: article_cost(T_max, d, C))
    return analysis, model_best
