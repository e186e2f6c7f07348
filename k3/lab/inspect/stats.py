"""The statistics `k3 lab inspect` reports and the verdicts it draws from them, with their thresholds:
KDA half-lives per channel and their spread within a head, expert load imbalance, the attention a head
puts back on the earlier copy of a prompt said twice."""

from __future__ import annotations

import math

import torch

HALF_LIFE_CAP = 1e6  # tokens; a log decay that rounds to 0 in float32 forgets nothing: shown at the cap
# verdict thresholds, stated in the notes
ATTN_RES_SELECTIVE = 0.8  # mean per-token entropy / log N at or below this: a mix is selective
BALANCED = 1.5  # expert load max/mean at or below this: balanced
CHANNEL_SPREAD = (2.0, 1.25)  # within-head p90/p10 of channel half-lives: holds / partly
RETRIEVAL = 0.3  # best head's mean attention on the earlier copy: holds; partly at 3x uniform


def half_life(g: torch.Tensor) -> torch.Tensor:
    """Tokens until a decay of exp(g) per token halves the state: ln 2 / -g, capped at HALF_LIFE_CAP."""
    return (math.log(2) / (-g.double()).clamp_min(math.log(2) / HALF_LIFE_CAP)).clamp(max=HALF_LIFE_CAP)


def imbalance(load: torch.Tensor) -> float:
    """max / mean of the assignments per expert (1 = perfectly even)."""
    load = load.double()
    return (load.max() / load.mean()).item() if load.sum() > 0 else float("nan")


def channel_half_lives(rec: dict) -> torch.Tensor:
    """Half-life [H, K] of each (head, key channel), from its log decay averaged over tokens."""
    return half_life(rec["g_sum"] / rec["tokens"])


def within_head_spread(hl: torch.Tensor) -> torch.Tensor:
    """Per head: 90th / 10th percentile of its channels' half-lives (1 = every channel forgets alike)."""
    q = torch.quantile(hl.double().log(), torch.tensor([0.1, 0.9], dtype=torch.float64), dim=-1)
    return (q[1] - q[0]).exp()


def retrieval_scores(probs: torch.Tensor, period: int) -> dict[str, torch.Tensor]:
    """Per head [H], averaged over the queries of the second copy (positions i >= period + 1) of a
    prompt said twice: "copy" = attention on the same token in the first copy (i - period), "induction"
    = on the token after it (i - period + 1), "previous" = on i - 1, and "uniform" = what a uniform
    causal attention would give one position (the mean of 1 / (i + 1))."""
    T = probs.shape[-1]
    rows = torch.arange(period + 1, T)
    if len(rows) == 0:
        raise ValueError(f"retrieval_scores: a prompt of {T} tokens has no second copy for period {period}")
    return {
        "copy": probs[:, rows, rows - period].mean(-1),
        "induction": probs[:, rows, rows - period + 1].mean(-1),
        "previous": probs[:, rows, rows - 1].mean(-1),
        "uniform": torch.full((probs.shape[0],), (1.0 / (rows + 1).double()).mean().item()),
    }


def forgets(hl: torch.Tensor) -> torch.Tensor:
    """Per head [H]: whether any of its channels' half-lives [H, K] is under HALF_LIFE_CAP."""
    return (hl < HALF_LIFE_CAP).any(-1)


def attn_res_verdict(entropies: list[float]) -> str:
    """Selective depth retrieval: holds when the median mix's normalised entropy is <= ATTN_RES_SELECTIVE,
    partly when at least one mix's is; does not hold when every mix stays near uniform."""
    if not entropies:
        return "not measurable here"
    median = sorted(entropies)[len(entropies) // 2]
    return (
        "holds"
        if median <= ATTN_RES_SELECTIVE
        else "partly"
        if min(entropies) <= ATTN_RES_SELECTIVE
        else "does not hold"
    )


def balance_verdict(with_bias: list[float], without: list[float]) -> str:
    """Mean max/mean load over the MoE layers: holds when it is <= BALANCED with the bias and no higher
    than without it; partly when only one of the two is true."""
    if not with_bias:
        return "not measurable here"
    w, wo = sum(with_bias) / len(with_bias), sum(without) / len(without)
    ok = (w <= BALANCED) + (w <= wo)
    return {2: "holds", 1: "partly", 0: "does not hold"}[ok]


def channel_verdict(spreads: list[float]) -> str:
    """Per-channel forgetting, from the within-head spreads of the heads that forget (none: does not hold)."""
    if not spreads:
        return "does not hold"
    median = sorted(spreads)[len(spreads) // 2]
    return "holds" if median >= CHANNEL_SPREAD[0] else "partly" if median >= CHANNEL_SPREAD[1] else "does not hold"


def retrieval_verdict(best: float, uniform: float) -> str:
    """From the best head's attention on the earlier copy: holds at >= RETRIEVAL, partly at >= 3x what
    uniform attention gives."""
    return "holds" if best >= RETRIEVAL else "partly" if best >= 3 * uniform else "does not hold"
