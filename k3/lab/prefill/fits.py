"""The small fits `k3 lab prefill` sets the cost models (`k3.ops.cost`: the article's and k3's count)
against measured times with: seconds per unit of cost (`fit_scale`), how far a prediction is from a
time (`error_factor`), the exponent of a power law (`loglog_slope`)."""

from __future__ import annotations

import math
import statistics


def fit_scale(costs: list[float], seconds: list[float]) -> float:
    """Seconds per unit of cost, least squares on the relative error: minimises sum((a·x/t - 1)²)."""
    if len(costs) != len(seconds) or not costs:
        raise ValueError(f"fit_scale: needs as many costs as times, at least one; got {len(costs)} and {len(seconds)}")
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
