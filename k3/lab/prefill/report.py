"""What `k3 lab prefill` writes: its claims with their verdicts, the tables, the notes that explain where
the cost model and the clock part ways, and the two figures, all from the measured times and the fits
(`k3.lab.prefill.analyse`). The notes' words are k3/lab/templates/prefill.md's."""

from __future__ import annotations

import statistics
from pathlib import Path

from ...ops.cost import OPS, article_cost
from .. import plots
from ..report import Claim, Figure, Table
from ..text import paragraph
from .measure import FULL, Sweep, op_cost

LABELS = {"linear_attn": "linear attention", "kda": "KDA"}

# verdict thresholds (stated in the notes)
FIT_FACTOR = 1.5  # a cost model holds when every prediction is within this factor of the measurement
TYPICAL_FACTOR = 2.0  # ... and partly when the median prediction is within this one
LINEAR_SLOPE = (0.8, 1.25)  # log-log slope of time against T at fixed C that counts as linear
QUADRATIC_SLOPE = (1.7, 2.3)  # ... and of the C = T time that counts as quadratic


def _verdict(condition_all: bool, condition_some: bool) -> str:
    return "holds" if condition_all else "partly" if condition_some else "does not hold"


def claims(sweep: Sweep, analysis: dict, model_best: int) -> list[Claim]:
    out = []
    for op in OPS:
        fit = analysis[op]["models"]["article"]
        measured = (
            f"{LABELS[op]}: one fitted constant predicts {len(sweep.chunks)} chunk sizes x "
            f"{len(sweep.lengths)} lengths within a factor {fit['worst']:.2f} "
            f"(median {fit['median']:.2f})"
        )
        if fit["full_worst"] is not None:
            measured += f"; at C = T it is off by up to {fit['full_worst']:.1f}x"
        what = (
            "the form the model is derived for"
            if op == "linear_attn"
            else "the delta rule's chunk form, UT transform included"
        )
        out.append(
            Claim(
                f"The chunked form costs 2·L·d² + 2·L·C·d ({what})",
                measured,
                _verdict(fit["worst"] <= FIT_FACTOR, fit["median"] <= TYPICAL_FACTOR),
            )
        )

    slopes = [s for op in OPS for s in analysis[op]["slopes"].values()]
    inside = [LINEAR_SLOPE[0] <= s <= LINEAR_SLOPE[1] for s in slopes]
    out.append(
        Claim(
            "At a fixed chunk size the cost is linear in L (attention grows O(N²), this does not)",
            "time ∝ T^k with k = "
            + ", ".join(
                f"{LABELS[op]} {min(analysis[op]['slopes'].values()):.2f}-{max(analysis[op]['slopes'].values()):.2f}"
                for op in OPS
            )
            + " over the chunk sizes",
            _verdict(
                all(inside),
                statistics.median(slopes) >= LINEAR_SLOPE[0] and statistics.median(slopes) <= LINEAR_SLOPE[1],
            )
            if slopes
            else "not measurable here",
        )
    )

    full_slopes = {op: analysis[op]["full_slope"] for op in OPS}
    if any(s is None for s in full_slopes.values()):
        out.append(
            Claim(
                "C = L is full attention: the second term becomes 2·L²·d, quadratic",
                "C = T measured at fewer than two lengths",
                "not measurable here",
            )
        )
    else:
        quadratic = [QUADRATIC_SLOPE[0] <= s <= QUADRATIC_SLOPE[1] for s in full_slopes.values()]
        caps = ", ".join(f"{LABELS[op]} T ≤ {sweep.full_cap[op]:,}" for op in OPS)
        out.append(
            Claim(
                "C = L is full attention: the second term becomes 2·L²·d, quadratic",
                "one-chunk time ∝ T^k with k = "
                + ", ".join(f"{LABELS[op]} {s:.2f}" for op, s in full_slopes.items())
                + f" ({caps})",
                _verdict(all(quadratic), any(quadratic)),
            )
        )

    best = {op: analysis[op]["best_C"] for op in OPS}
    penalty = {op: analysis[op]["at_max"][model_best] / analysis[op]["at_max"][best[op]] for op in OPS}
    out.append(
        Claim(
            "By FLOPs the smallest C is cheapest, but not in wall-clock time: C = 64 or 128 runs best "
            "(on GPU tensor cores)",
            f"at T = {max(sweep.lengths):,} the FLOP model's best is C = {model_best}; measured best: "
            + ", ".join(f"{LABELS[op]} C = {best[op]} (C = {model_best} is {penalty[op]:.2f}x slower)" for op in OPS),
            _verdict(all(best[op] >= 64 for op in OPS), any(best[op] != model_best for op in OPS)),
        )
    )
    return out


def _ms(seconds: float | None) -> str:
    """Milliseconds, three significant digits (or whole ms from 100 up); a dash when not measured."""
    if seconds is None:
        return "—"
    ms = seconds * 1e3
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.3g}"


def tables(sweep: Sweep, times: dict, analysis: dict, breakdown: list[dict], gemm: float) -> list[Table]:
    T_max, d = max(sweep.lengths), sweep.dim
    header = ["op", "T"] + [f"C = {C}" for C in sweep.chunks] + ["C = T"]
    rows = [
        [LABELS[op], f"{T:,}"] + [_ms(times.get((op, T, C))) for C in sweep.chunks] + [_ms(times.get((op, T, FULL)))]
        for op in OPS
        for T in sweep.lengths
    ]
    measured = Table(
        f"Measured prefill time (ms): B = 1, H = {sweep.heads}, d = {d}, float32, best of "
        f"{sweep.rounds} interleaved rounds ({sweep.full_rounds} for C = T; — : not run, C = T only "
        "up to the caps in the notes)",
        header,
        rows,
    )

    rows = []
    for op in OPS:
        fits = analysis[op]["models"]
        cases = [(C, T_max, analysis[op]["at_max"][C]) for C in analysis[op]["at_max"]]
        cases += [(f"T = {T:,}", T, t) for T, _, t in analysis[op]["full"][-1:]]
        for label, T, t in cases:
            C = T if isinstance(label, str) else label
            rows.append(
                [
                    LABELS[op],
                    f"{T:,}",
                    label,
                    _ms(t),
                    _ms(fits["article"]["scale"] * article_cost(T, d, C)),
                    _ms(fits["k3 count"]["scale"] * op_cost(op, T, d, C)),
                    f"{op_cost(op, T, d, C) / article_cost(T, d, C):.2f}",
                ]
            )
    versus = Table(
        "Measured against the two cost models, each with one constant fitted on all chunked points (ms); "
        "the last column: how many multiply-adds k3 runs per multiply-add of the article's model",
        ["op", "T", "C", "measured", "article model", "k3 count", "k3 / article work"],
        rows,
    )

    rows = []
    for op in OPS:
        for name, fit in analysis[op]["models"].items():
            rows.append(
                [
                    LABELS[op],
                    name,
                    f"{2e-9 / fit['scale']:.3g}",
                    f"{fit['median']:.2f}",
                    f"{fit['worst']:.2f}",
                    "—" if fit["full_worst"] is None else f"{fit['full_worst']:.2f}",
                ]
            )
    fits = Table(
        f"The fits: effective GFLOP/s (2 per multiply-add) and how far predictions fall from the measurement "
        f"(a factor ≥ 1), on the chunked points and, out of the fit, at C = T (1024³ GEMM: {gemm:.1f} GFLOP/s)",
        ["op", "model", "fitted GFLOP/s", "median factor", "worst factor", "worst at C = T"],
        rows,
    )

    rows = [
        [
            LABELS[r["op"]],
            r["C"],
            _ms(r["wall"]),
            f"{_ms(r['matmul'])} ({r['matmul'] / r['wall']:.0%})",
            f"{2 * r['macs'] / r['matmul'] / 1e9:.1f}",
            f"{_ms(r['other'])} ({r['other'] / r['wall']:.0%})",
            f"{r['top']} ({r['top_s'] / r['wall']:.0%})",
            f"{_ms(r['outside'])} ({r['outside'] / r['wall']:.0%})",
        ]
        for r in breakdown
    ]
    where = Table(
        f"Where one call's time goes at T = {sweep.breakdown_tokens:,} (every aten op timed, so the call "
        f"runs a little slower than above): the matmuls and triangular solves the cost models count, "
        f"the other ops, and Python between ops (1024³ GEMM: {gemm:.1f} GFLOP/s)",
        [
            "op",
            "C",
            "call (ms)",
            "matmuls (ms)",
            "matmul GFLOP/s",
            "other ops (ms)",
            "largest other op",
            "outside ops (ms)",
        ],
        rows,
    )
    return [measured, versus, fits, where]


def notes(sweep: Sweep, analysis: dict, breakdown: list[dict], gemm: float, model_best: int) -> list[str]:
    T_max, d, H = max(sweep.lengths), sweep.dim, sweep.heads
    kda, la = analysis["kda"], analysis["linear_attn"]
    share = {(r["op"], r["C"]): r for r in breakdown}

    def matmul_shares(op: str) -> str:
        values = [share[(op, C)]["matmul"] / share[(op, C)]["wall"] for C in sweep.chunks]
        return f"{min(values):.0%}-{max(values):.0%}"

    small, large = share[("linear_attn", sweep.chunks[0])], share[("linear_attn", sweep.chunks[-1])]
    ratios = [op_cost("kda", T_max, d, C) / article_cost(T_max, d, C) for C in sweep.chunks]
    counted = all(r["macs"] == round(H * op_cost(r["op"], sweep.breakdown_tokens, d, r["C"])) for r in breakdown)
    states = H * d * (d + 1) * T_max / sweep.chunks[0] * 4 / 2**20
    la_full = la["full"][:1] + la["full"][-1:]
    return [
        paragraph(
            "prefill",
            "model-vs-measurement",
            linear_matmuls=matmul_shares("linear_attn"),
            kda_matmuls=matmul_shares("kda"),
            small_cumsum=small["cumsum"] / small["wall"],
            small_C=small["C"],
            large_cumsum=large["cumsum"] / large["wall"],
            large_C=large["C"],
            gemm=gemm,
            T_max=T_max,
            linear_best=la["best_C"],
            kda_best=kda["best_C"],
            model_best=model_best,
        ),
        paragraph(
            "prefill",
            "k3-count",
            tokens=sweep.breakdown_tokens,
            counted=paragraph("prefill", "counted-yes" if counted else "counted-no"),
            low_ratio=min(ratios),
            high_ratio=max(ratios),
            first_C=sweep.chunks[0],
            last_C=sweep.chunks[-1],
        ),
        paragraph(
            "prefill",
            "slopes",
            linear_slopes=_range(la["slopes"]),
            kda_slopes=_range(kda["slopes"]),
            states=states,
            T_max=T_max,
            first_C=sweep.chunks[0],
        ),
        paragraph(
            "prefill",
            "one-chunk",
            linear_cap=sweep.full_cap["linear_attn"],
            heads=H,
            scores_gib=H * sweep.full_cap["linear_attn"] ** 2 * 4 / 2**30,
            kda_cap=sweep.full_cap["kda"],
            linear_full=_fmt(la["full_slope"]),
            kda_full=_fmt(kda["full_slope"]),
            sizes=" to ".join(f"{H * T**2 * 4 / 2**20:,.0f} MiB" for T, _, _ in la_full),
        ),
        paragraph(
            "prefill",
            "verdicts",
            fit_factor=FIT_FACTOR,
            typical_factor=TYPICAL_FACTOR,
            linear_low=LINEAR_SLOPE[0],
            linear_high=LINEAR_SLOPE[1],
            quadratic_low=QUADRATIC_SLOPE[0],
            quadratic_high=QUADRATIC_SLOPE[1],
        ),
        paragraph("prefill", "timing"),
    ]


def _fmt(slope: float | None) -> str:
    return "—" if slope is None else f"{slope:.2f}"


def _range(values: dict) -> str:
    return f"{min(values.values()):.2f}-{max(values.values()):.2f}" if values else "—"


def figures(docs: Path, sweep: Sweep, times: dict, analysis: dict) -> list[Figure]:
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
            ax.plot(
                Cs,
                [fits["article"]["scale"] * article_cost(T_max, d, C) * 1e3 for C in Cs],
                "--",
                color="C1",
                label="article: 2Ld² + 2LCd",
            )
            ax.plot(
                Cs,
                [fits["k3 count"]["scale"] * op_cost(op, T_max, d, C) * 1e3 for C in Cs],
                ":",
                color="C2",
                label="k3's multiply-adds",
            )
            ax.set_xscale("log", base=2)
            ax.set_xticks(Cs, [str(C) for C in Cs])
            ax.set_ylim(bottom=0)
            ax.set_xlabel("chunk size C")
            ax.set_ylabel("prefill time (ms)")
            ax.set_title(f"{LABELS[op]}, T = {T_max:,}")
            ax.legend(fontsize=8)
    return [
        Figure(
            "figures/prefill_time_vs_T.png",
            "Prefill time against T per chunk size (log-log), with the article's model (one fitted constant)",
        ),
        Figure(
            "figures/prefill_time_vs_C.png",
            f"Prefill time against the chunk size at T = {T_max:,}, with both cost models",
        ),
    ]
