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
  triangular matrix, about C³/3 multiply-adds per chunk. `k3_cost` counts what it runs exactly (a
  test checks the count against every matmul and triangular solve the op dispatches): in the chunked
  regime (C ≤ 128 at d = 64) that is 1.7-1.8x the article's count, nearly a constant, but at C = T
  the inverse makes the "full attention" end cubic in T, not quadratic.

One constant (seconds per multiply-add) is fitted per model on the chunked points, in relative terms,
and the prediction is compared with every point, the C = T ones included (out of the fit). A breakdown
of one call by aten op (`OpLedger`) shows why one constant cannot fit all C: much of the time is in
work that has no multiply-adds at all.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..bench.ops import _inputs, interleaved_best
from ..bench.timing import matmul_gflops
from ..ops import chunk_kda, chunk_linear_attn
from ..ops.chunk import sub_chunk_size
from . import plots
from .report import Claim, Figure, Result, Table, command

OPS = ("linear_attn", "kda")
LABELS = {"linear_attn": "linear attention", "kda": "KDA"}
FULL = "T"  # the key of the C = T (fully parallel) column


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
    "smoke": Sweep((64, 128), (16, 32), heads=2, dim=16, rounds=1, full_rounds=1,
                   full_cap={"linear_attn": 128, "kda": 128}, breakdown_tokens=256),
    "quick": Sweep((1024, 2048, 4096, 8192, 16384), (16, 32, 64, 128), heads=8, dim=64, rounds=5, full_rounds=2,
                   full_cap={"linear_attn": 4096, "kda": 2048}, breakdown_tokens=4096),
    "full": Sweep((1024, 2048, 4096, 8192, 16384), (16, 32, 64, 128), heads=8, dim=64, rounds=9, full_rounds=3,
                  full_cap={"linear_attn": 8192, "kda": 4096}, breakdown_tokens=4096),
}

# verdict thresholds (stated in the notes)
FIT_FACTOR = 1.5  # a cost model holds when every prediction is within this factor of the measurement
TYPICAL_FACTOR = 2.0  # ... and partly when the median prediction is within this one
LINEAR_SLOPE = (0.8, 1.25)  # log-log slope of time against T at fixed C that counts as linear
QUADRATIC_SLOPE = (1.7, 2.3)  # ... and of the C = T time that counts as quadratic


# -- the two cost models, per head, in multiply-adds -----------------------------------------------------

def _check_shape(T: int, d: int, C: int) -> None:
    for name, value in (("T", T), ("d", d), ("C", C)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"cost model: `{name}` must be a positive int, got {value!r}")


def article_cost(T: int, d: int, C: int) -> float:
    """The article's cost of the chunked form per head, 2·L·d² + 2·L·C·d (in multiply-adds: it counts a
    (C x d)(d x d) product as C·d·d). C larger than T means one chunk, C = T."""
    _check_shape(T, d, C)
    C = min(C, T)
    return 2.0 * T * d * d + 2.0 * T * C * d


def k3_cost(op: str, T: int, d: int, C: int) -> float:
    """Multiply-adds per head of k3's `chunk_<op>` (K = V = d), every matmul and triangular solve counted.

    linear_attn: per chunk K_iᵀ V1_i and Q_i S (V1 = [V | 1], d + 1 columns) and the full C x C score
    block Q_i K_iᵀ times V1_i.
    kda: per chunk of C = m·s tokens (sub-chunks of s <= 32, as the op splits them) the state steps
    W S, K_endᵀ U and Q S (3·C·d²); the lower-triangular blocks of A_qk and A_kk (C·d·(C + s)); the UT
    transform applied to K and V (C·d·(C + s)) and A_qk U (C·d·(C + s)/2); and the inverse of I + A: a
    triangular solve per diagonal block (s²(s - 1)/2 each) and its block rows, s³·m(m² - 1)/3 — about
    C³/3, the term the article's model does not have. The last chunk is padded to C tokens."""
    _check_shape(T, d, C)
    C = min(C, T)
    padded = math.ceil(T / C) * C
    if op == "linear_attn":
        return padded * (2.0 * d * (d + 1) + C * (2.0 * d + 1))
    if op == "kda":
        s = sub_chunk_size(C)
        m = C // s
        per_chunk = (3.0 * C * d * d + 2.5 * C * d * (C + s) + m * s * s * (s - 1) / 2
                     + s ** 3 * m * (m * m - 1) / 3)
        return padded // C * per_chunk
    raise ValueError(f"k3_cost: `op` must be one of {OPS}, got {op!r}")


def fit_scale(costs: list[float], seconds: list[float]) -> float:
    """Seconds per unit of cost, least squares on the relative error: minimises sum((a·x/t - 1)²)."""
    if len(costs) != len(seconds) or not costs:
        raise ValueError(f"fit_scale: needs as many costs as times, at least one; got {len(costs)} and "
                         f"{len(seconds)}")
    ratios = [x / t for x, t in zip(costs, seconds)]
    return sum(ratios) / sum(r * r for r in ratios)


def error_factor(predicted: float, measured: float) -> float:
    """How far apart two positive numbers are, as a factor >= 1."""
    return max(predicted / measured, measured / predicted)


def loglog_slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log y against log x (the exponent of a power law)."""
    if len(xs) < 2 or len(xs) != len(ys):
        raise ValueError(f"loglog_slope: needs two or more (x, y) pairs, got {len(xs)} x and {len(ys)} y")
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


# -- measuring -------------------------------------------------------------------------------------------

def _op_call(op: str, inputs: tuple, C: int):
    q, k, v, g, beta = inputs
    if op == "linear_attn":
        return lambda: chunk_linear_attn(q, k, v, chunk_size=C)
    return lambda: chunk_kda(q, k, v, g, beta, chunk_size=C)


def measure_times(sweep: Sweep) -> dict[tuple[str, int, int | str], float]:
    """Best-of-rounds seconds for every (op, T, C), C = "T" for the one-chunk form. The chunked cases of
    one T are interleaved round by round; the one-chunk cases (seconds each) get fewer rounds of their
    own and no warm-up call."""
    times: dict[tuple[str, int, int | str], float] = {}
    for T in sweep.lengths:
        inputs = _inputs(T, sweep.heads, sweep.dim)
        chunked = {(op, T, C): _op_call(op, inputs, C) for op in OPS for C in sweep.chunks if C < T}
        full = {(op, T, FULL): _op_call(op, inputs, T) for op in OPS if T <= sweep.full_cap[op]}
        with torch.inference_mode():
            times.update(interleaved_best(chunked, sweep.rounds))
            times.update(interleaved_best(full, sweep.full_rounds, cold=frozenset(full)))
    return times


MATMULS = ("bmm", "baddbmm", "baddbmm_", "mm", "addmm", "addmm_", "mv", "addmv", "dot", "matmul",
           "linalg_solve_triangular")


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
            raise RuntimeError(f"OpLedger: {name} reached the ledger undecomposed; its multiply-adds would "
                               "go uncounted")
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


def time_breakdown(sweep: Sweep) -> list[dict]:
    """Where the time of one call goes, per op and C at T = sweep.breakdown_tokens (best of two
    instrumented calls after a warm-up): matmuls and triangular solves (the work the cost models
    count), the other aten ops (elementwise decay factors, masks, copies, cumulative sums) and what
    runs outside any op (Python and dispatch between ops)."""
    T = sweep.breakdown_tokens
    inputs = _inputs(T, sweep.heads, sweep.dim)
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
            rows.append({"op": op, "C": C, "wall": wall, "matmul": matmul, "macs": ledger.macs,
                         "other": sum(others.values()), "top": top, "top_s": others[top],
                         "cumsum": ledger.seconds["cumsum"],
                         "outside": max(0.0, wall - matmul - sum(others.values()))})
    return rows


# -- the experiment --------------------------------------------------------------------------------------

def run(mode: str, docs: Path, **options) -> Result:
    if options:
        raise ValueError(f"k3 lab prefill takes no options, got {sorted(options)}")
    sweep = SWEEPS[mode]
    T_max, d, H = max(sweep.lengths), sweep.dim, sweep.heads
    times = measure_times(sweep)
    gemm = matmul_gflops(n=256 if mode == "smoke" else 1024)
    breakdown = time_breakdown(sweep)

    # fits: one constant per (op, model) on the chunked points
    models = {"article": lambda op, T, C: article_cost(T, d, C), "k3 count": lambda op, T, C: k3_cost(op, T, d, C)}
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
            per_model[name] = {"scale": scale, "median": statistics.median(factors), "worst": max(factors),
                               "full_worst": max(full_factors) if full_factors else None}
        at_max = {C: times[(op, T_max, C)] for C in sweep.chunks if (op, T_max, C) in times}
        slopes = {C: loglog_slope([T for T in sweep.lengths if (op, T, C) in times],
                                  [times[(op, T, C)] for T in sweep.lengths if (op, T, C) in times])
                  for C in sweep.chunks if sum((op, T, C) in times for T in sweep.lengths) >= 2}
        full_slope = loglog_slope([T for T, _, _ in full], [t for *_, t in full]) if len(full) >= 2 else None
        analysis[op] = {"models": per_model, "at_max": at_max, "best_C": min(at_max, key=at_max.get),
                        "slopes": slopes, "full_slope": full_slope, "full": full}
    model_best = min(sweep.chunks, key=lambda C: article_cost(T_max, d, C))

    figures = _figures(docs, sweep, times, analysis)
    claims = _claims(sweep, analysis, model_best)
    tables = _tables(sweep, times, analysis, breakdown, gemm)
    notes = _notes(sweep, analysis, breakdown, gemm, model_best)
    setup = {"shape": f"B = 1, H = {H}, K = V = d = {d}, float32, inputs as k3 bench ops (seed 0; KDA gate "
                      "g = -5 sigmoid(x))", "lengths": list(sweep.lengths), "chunk_sizes": list(sweep.chunks),
             "C = T up to": sweep.full_cap, "timing": f"best of {sweep.rounds} interleaved rounds per T "
             f"({sweep.full_rounds} for C = T)",
             "threads": torch.get_num_threads(), "gemm_gflops": round(gemm, 1)}
    return Result(name="prefill", title="Prefill cost: the chunk size against the FLOP model", mode=mode,
                  command=command("prefill", mode), claims=claims, tables=tables, figures=figures, notes=notes,
                  setup=setup)


def _verdict(condition_all: bool, condition_some: bool) -> str:
    return "holds" if condition_all else "partly" if condition_some else "does not hold"


def _claims(sweep: Sweep, analysis: dict, model_best: int) -> list[Claim]:
    claims = []
    for op in OPS:
        fit = analysis[op]["models"]["article"]
        measured = (f"{LABELS[op]}: one fitted constant predicts {len(sweep.chunks)} chunk sizes x "
                    f"{len(sweep.lengths)} lengths within a factor {fit['worst']:.2f} "
                    f"(median {fit['median']:.2f})")
        if fit["full_worst"] is not None:
            measured += f"; at C = T it is off by up to {fit['full_worst']:.1f}x"
        what = ("the form the model is derived for" if op == "linear_attn"
                else "the delta rule's chunk form, UT transform included")
        claims.append(Claim(f"The chunked form costs 2·L·d² + 2·L·C·d ({what})", measured,
                            _verdict(fit["worst"] <= FIT_FACTOR, fit["median"] <= TYPICAL_FACTOR)))

    slopes = [s for op in OPS for s in analysis[op]["slopes"].values()]
    inside = [LINEAR_SLOPE[0] <= s <= LINEAR_SLOPE[1] for s in slopes]
    claims.append(Claim(
        "At a fixed chunk size the cost is linear in L (attention grows O(N²), this does not)",
        "time ∝ T^k with k = " + ", ".join(
            f"{LABELS[op]} {min(analysis[op]['slopes'].values()):.2f}-{max(analysis[op]['slopes'].values()):.2f}"
            for op in OPS) + " over the chunk sizes",
        _verdict(all(inside), statistics.median(slopes) >= LINEAR_SLOPE[0]
                 and statistics.median(slopes) <= LINEAR_SLOPE[1]) if slopes else "not measurable here"))

    full_slopes = {op: analysis[op]["full_slope"] for op in OPS}
    if any(s is None for s in full_slopes.values()):
        claims.append(Claim("C = L is full attention: the second term becomes 2·L²·d, quadratic",
                            "C = T measured at fewer than two lengths", "not measurable here"))
    else:
        quadratic = [QUADRATIC_SLOPE[0] <= s <= QUADRATIC_SLOPE[1] for s in full_slopes.values()]
        caps = ", ".join(f"{LABELS[op]} T ≤ {sweep.full_cap[op]:,}" for op in OPS)
        claims.append(Claim(
            "C = L is full attention: the second term becomes 2·L²·d, quadratic",
            "one-chunk time ∝ T^k with k = " + ", ".join(f"{LABELS[op]} {s:.2f}" for op, s in full_slopes.items())
            + f" ({caps})", _verdict(all(quadratic), any(quadratic))))

    best = {op: analysis[op]["best_C"] for op in OPS}
    penalty = {op: analysis[op]["at_max"][model_best] / analysis[op]["at_max"][best[op]] for op in OPS}
    claims.append(Claim(
        "By FLOPs the smallest C is cheapest, but not in wall-clock time: C = 64 or 128 runs best "
        "(on GPU tensor cores)",
        f"at T = {max(sweep.lengths):,} the FLOP model's best is C = {model_best}; measured best: "
        + ", ".join(f"{LABELS[op]} C = {best[op]} (C = {model_best} is {penalty[op]:.2f}x slower)" for op in OPS),
        _verdict(all(best[op] >= 64 for op in OPS), any(best[op] != model_best for op in OPS))))
    return claims


def _ms(seconds: float | None) -> str:
    """Milliseconds, three significant digits (or whole ms from 100 up); a dash when not measured."""
    if seconds is None:
        return "—"
    ms = seconds * 1e3
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.3g}"


def _tables(sweep: Sweep, times: dict, analysis: dict, breakdown: list[dict], gemm: float) -> list[Table]:
    T_max, d = max(sweep.lengths), sweep.dim
    header = ["op", "T"] + [f"C = {C}" for C in sweep.chunks] + ["C = T"]
    rows = [[LABELS[op], f"{T:,}"] + [_ms(times.get((op, T, C))) for C in sweep.chunks]
            + [_ms(times.get((op, T, FULL)))] for op in OPS for T in sweep.lengths]
    measured = Table(f"Measured prefill time (ms): B = 1, H = {sweep.heads}, d = {d}, float32, best of "
                     f"{sweep.rounds} interleaved rounds ({sweep.full_rounds} for C = T; — : not run, C = T only "
                     "up to the caps in the notes)",
                     header, rows)

    rows = []
    for op in OPS:
        fits = analysis[op]["models"]
        cases = [(C, T_max, analysis[op]["at_max"][C]) for C in analysis[op]["at_max"]]
        cases += [(f"T = {T:,}", T, t) for T, _, t in analysis[op]["full"][-1:]]
        for label, T, t in cases:
            C = T if isinstance(label, str) else label
            rows.append([LABELS[op], f"{T:,}", label, _ms(t), _ms(fits["article"]["scale"] * article_cost(T, d, C)),
                         _ms(fits["k3 count"]["scale"] * k3_cost(op, T, d, C)),
                         f"{k3_cost(op, T, d, C) / article_cost(T, d, C):.2f}"])
    versus = Table("Measured against the two cost models, each with one constant fitted on all chunked points (ms); "
                   "the last column: how many multiply-adds k3 runs per multiply-add of the article's model",
                   ["op", "T", "C", "measured", "article model", "k3 count", "k3 / article work"], rows)

    rows = []
    for op in OPS:
        for name, fit in analysis[op]["models"].items():
            rows.append([LABELS[op], name, f"{2e-9 / fit['scale']:.3g}", f"{fit['median']:.2f}", f"{fit['worst']:.2f}",
                         "—" if fit["full_worst"] is None else f"{fit['full_worst']:.2f}"])
    fits = Table(f"The fits: effective GFLOP/s (2 per multiply-add) and how far predictions fall from the measurement "
                 f"(a factor ≥ 1), on the chunked points and, out of the fit, at C = T (1024³ GEMM: {gemm:.1f} GFLOP/s)",
                 ["op", "model", "fitted GFLOP/s", "median factor", "worst factor", "worst at C = T"], rows)

    rows = [[LABELS[r["op"]], r["C"], _ms(r["wall"]), f"{_ms(r['matmul'])} ({r['matmul'] / r['wall']:.0%})",
             f"{2 * r['macs'] / r['matmul'] / 1e9:.1f}", f"{_ms(r['other'])} ({r['other'] / r['wall']:.0%})",
             f"{r['top']} ({r['top_s'] / r['wall']:.0%})", f"{_ms(r['outside'])} ({r['outside'] / r['wall']:.0%})"]
            for r in breakdown]
    where = Table(f"Where one call's time goes at T = {sweep.breakdown_tokens:,} (every aten op timed, so the call "
                  f"runs a little slower than above): the matmuls and triangular solves the cost models count, "
                  f"the other ops, and Python between ops (1024³ GEMM: {gemm:.1f} GFLOP/s)",
                  ["op", "C", "call (ms)", "matmuls (ms)", "matmul GFLOP/s", "other ops (ms)", "largest other op",
                   "outside ops (ms)"], rows)
    return [measured, versus, fits, where]


def _notes(sweep: Sweep, analysis: dict, breakdown: list[dict], gemm: float, model_best: int) -> list[str]:
    T_max, d, H = max(sweep.lengths), sweep.dim, sweep.heads
    kda, la = analysis["kda"], analysis["linear_attn"]
    share = {(r["op"], r["C"]): r for r in breakdown}

    def matmul_shares(op: str) -> str:
        values = [share[(op, C)]["matmul"] / share[(op, C)]["wall"] for C in sweep.chunks]
        return f"{min(values):.0%}-{max(values):.0%}"

    small, large = share[("linear_attn", sweep.chunks[0])], share[("linear_attn", sweep.chunks[-1])]
    ratios = [k3_cost("kda", T_max, d, C) / article_cost(T_max, d, C) for C in sweep.chunks]
    counted = all(r["macs"] == round(H * k3_cost(r["op"], sweep.breakdown_tokens, d, r["C"])) for r in breakdown)
    states = H * d * (d + 1) * T_max / sweep.chunks[0] * 4 / 2 ** 20
    return [
        "Where the model and the measurement part ways: the model prices every multiply-add the same and counts "
        f"nothing else. Here the matmuls take only {matmul_shares('linear_attn')} of a linear-attention call and "
        f"{matmul_shares('kda')} of a KDA call (table above); the rest is work without multiply-adds - KDA's "
        "per-channel decay factors (exp, products, masks), copies between layouts, a Python step per chunk "
        "in KDA's state scan, and linear attention's cumulative sum over one d x (d + 1) state per chunk "
        f"({small['cumsum'] / small['wall']:.0%} of the call at C = {small['C']}, "
        f"{large['cumsum'] / large['wall']:.0%} at C = {large['C']}). Much of "
        "that work is per chunk and grows as the chunks get smaller; small matmuls also run below the big "
        f"GEMM's {gemm:.0f} GFLOP/s (column 'matmul GFLOP/s'). At T = {T_max:,} linear attention is fastest at "
        f"C = {la['best_C']}, KDA at C = {kda['best_C']}; the FLOP model puts the optimum at C = {model_best} "
        "(and at C = 1 below the grid).",
        "What k3's ops compute (`k3.lab.prefill.k3_cost`; the matmuls dispatched at T = "
        f"{sweep.breakdown_tokens:,} {'match it exactly' if counted else 'do NOT match it'}): linear attention "
        "runs exactly the article's terms (with V + 1 columns for the normaliser); KDA runs "
        f"{min(ratios):.2f}-{max(ratios):.2f}x the article's multiply-adds at C = {sweep.chunks[0]}-"
        f"{sweep.chunks[-1]} (three state products, A_kk and the UT corrections besides the two score "
        "products), nearly a constant that the fitted constant absorbs, plus the inverse of the C x C "
        "triangular matrix I + A, ~C³/3 per chunk: ~C²/3 per token, small against 3d² at these C, dominant "
        "at C = T, where the 'full attention' end of KDA is cubic in T, not quadratic. The article counts "
        "multiply-adds; the GFLOP/s above count two FLOPs each.",
        f"Time against T at fixed C: log-log slopes {_range(la['slopes'])} for linear attention, "
        f"{_range(kda['slopes'])} for KDA. k3's linear-attention chunk form materialises every chunk's state "
        f"at once, T·H·d·(d + 1)/C floats ({states:,.0f} MiB at T = {T_max:,}, C = {sweep.chunks[0]}), and runs "
        "a cumulative sum over them: memory traffic that outgrows the caches as T grows and can push the slope "
        "above 1. KDA works through cache-sized slabs of chunks, its temporaries the same size at every T.",
        f"C = T is the whole sequence as one chunk: run up to T = {sweep.full_cap['linear_attn']:,} for linear "
        f"attention (the T x T scores of {H} heads: {H * sweep.full_cap['linear_attn'] ** 2 * 4 / 2 ** 30:.2g} "
        f"GiB per product) and T = {sweep.full_cap['kda']:,} for KDA (cubic: the next doubling takes ~8x longer). "
        f"Linear attention's one-chunk time grows as T^{_fmt(la['full_slope'])}, not T^2: its score matrices are "
        "formed, masked and multiplied in memory, "
        + " to ".join(f"{H * T ** 2 * 4 / 2 ** 20:,.0f} MiB" for T, _, _ in (la["full"][:1] + la["full"][-1:]))
        + f" each, and leave the caches as T grows; KDA's as T^{_fmt(kda['full_slope'])}, the UT inverse.",
        f"Verdicts: a cost model holds when one constant predicts every chunked point within a factor "
        f"{FIT_FACTOR} (partly: the median point within {TYPICAL_FACTOR}); linear in L means a log-log slope in "
        f"[{LINEAR_SLOPE[0]}, {LINEAR_SLOPE[1]}] for every op and C (partly: the median slope); quadratic at "
        f"C = T a slope in [{QUADRATIC_SLOPE[0]}, {QUADRATIC_SLOPE[1]}] for both ops (partly: one); the "
        "chunk-size claim holds when both ops run fastest at C ≥ 64, partly when at least one runs fastest "
        "above the FLOP optimum.",
        "Timing: every case of one T is timed once per round, round after round, and keeps its best round "
        "(`k3.bench.ops.interleaved_best`), so the cells of a row share the machine's phases; default thread "
        "count, inference mode. On a busy machine absolute times stretch; read the fits and the ratios.",
    ]


def _fmt(slope: float | None) -> str:
    return "—" if slope is None else f"{slope:.2f}"


def _range(values: dict) -> str:
    return f"{min(values.values()):.2f}-{max(values.values()):.2f}" if values else "—"


def _figures(docs: Path, sweep: Sweep, times: dict, analysis: dict) -> list[Figure]:
    d, T_max = sweep.dim, max(sweep.lengths)
    by_T = docs / "figures" / "prefill_time_vs_T.png"
    with plots.figure(by_T, ncols=len(OPS)) as (fig, axes):
        for ax, op in zip(axes, OPS):
            scale = analysis[op]["models"]["article"]["scale"]
            for i, C in enumerate(sweep.chunks):
                Ts = [T for T in sweep.lengths if (op, T, C) in times]
                color = f"C{i}"
                ax.plot(Ts, [times[(op, T, C)] * 1e3 for T in Ts], "o-", color=color, label=f"C = {C}")
                ax.plot(Ts, [scale * article_cost(T, d, C) * 1e3 for T in Ts], "--", color=color, alpha=0.5)
            full = analysis[op]["full"]
            if full:
                Ts = [T for T, _, _ in full]
                ax.plot(Ts, [t * 1e3 for *_, t in full], "s-", color="black", label="C = T")
                ax.plot(Ts, [scale * article_cost(T, d, T) * 1e3 for T in Ts], "--", color="black", alpha=0.5)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length T")
            ax.set_ylabel("prefill time (ms)")
            ax.set_title(f"{LABELS[op]}: measured (solid), article model (dashed)")
            ax.legend(fontsize=8)
    by_C = docs / "figures" / "prefill_time_vs_C.png"
    with plots.figure(by_C, ncols=len(OPS)) as (fig, axes):
        for ax, op in zip(axes, OPS):
            at_max = analysis[op]["at_max"]
            Cs = sorted(at_max)
            fits = analysis[op]["models"]
            ax.plot(Cs, [at_max[C] * 1e3 for C in Cs], "o-", color="C0", label="measured")
            ax.plot(Cs, [fits["article"]["scale"] * article_cost(T_max, d, C) * 1e3 for C in Cs], "--",
                    color="C1", label="article: 2Ld² + 2LCd")
            ax.plot(Cs, [fits["k3 count"]["scale"] * k3_cost(op, T_max, d, C) * 1e3 for C in Cs], ":",
                    color="C2", label="k3's multiply-adds")
            ax.set_xscale("log", base=2)
            ax.set_xticks(Cs, [str(C) for C in Cs])
            ax.set_ylim(bottom=0)
            ax.set_xlabel("chunk size C")
            ax.set_ylabel("prefill time (ms)")
            ax.set_title(f"{LABELS[op]}, T = {T_max:,}")
            ax.legend(fontsize=8)
    return [Figure("figures/prefill_time_vs_T.png",
                   "Prefill time against T per chunk size (log-log), with the article's model (one fitted constant)"),
            Figure("figures/prefill_time_vs_C.png",
                   f"Prefill time against the chunk size at T = {T_max:,}, with both cost models")]
