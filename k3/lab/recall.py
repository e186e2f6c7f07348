"""Associative recall (MQAR, as in Zoology): can each mixer retrieve the value bound to a key, as the number of
key-value pairs grows past its state size?

The article: linear attention folds the history into a fixed D x D state, so "once the state exceeds its effective
capacity, associations begin to interfere because the update is additive and nothing leaves the cache"; DeltaNet's
delta rule overwrites instead of piling up; and in the hybrid "attention is the most effective selective-read
mechanism", restored by the periodic MLA layers. Here every mixer gets the same width, depth, steps, data and
seed; one model per mixer (and per state size) is trained on a mixture of pair counts and scored per count.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from .report import Claim, Figure, Result, Table, command
from .synthetic import LABELS, MIXERS, Size, accuracy_by_kind, mixer_config, run_jobs, train_on_task
from .tasks import Vocab, mqar


@dataclass(frozen=True)
class Plan:
    head_dims: tuple[int, ...]  # the linear mixers' state per head is head_dim x head_dim
    seq_lens: tuple[int, ...]
    pairs: tuple[int, ...]
    steps: int
    batch: int
    width: int = 64
    layers: int = 4
    lr: float = 1e-2
    eval_batch: int = 256
    seed: int = 0


PLANS = {
    "smoke": Plan(head_dims=(4,), seq_lens=(24,), pairs=(1, 2, 4), steps=3, batch=8, width=16, eval_batch=16),
    "quick": Plan(head_dims=(8,), seq_lens=(48,), pairs=(1, 2, 4, 8, 12), steps=700, batch=32),
    "full": Plan(head_dims=(4, 8, 16), seq_lens=(64, 128), pairs=(1, 2, 4, 8, 12, 16, 24, 32), steps=3000,
                 batch=64),
}
VOCAB = Vocab(num_keys=32, num_values=32)


def score_mixer(plan: Plan, mixer: str, head_dim: int, seq_len: int) -> dict[int, float]:
    """Train one `mixer` model on pair counts drawn uniformly from plan.pairs (those that fit in seq_len) and
    return its accuracy per pair count on fresh held-out sequences (a different seed from training)."""
    pairs = [p for p in plan.pairs if 4 * p - 1 <= seq_len and p <= VOCAB.num_keys]
    size = Size(width=plan.width, layers=plan.layers, head_dim=head_dim, max_len=seq_len)

    def sample(g: torch.Generator):
        p = pairs[int(torch.randint(len(pairs), (1,), generator=g))]
        return mqar(plan.batch, seq_len, p, VOCAB, generator=g)

    model, _ = train_on_task(mixer_config(mixer, VOCAB.size, size), sample, plan.steps, lr=plan.lr, seed=plan.seed)
    test = torch.Generator().manual_seed(10_000 + plan.seed)
    return {p: accuracy_by_kind(model, mqar(plan.eval_batch, seq_len, p, VOCAB, generator=test))[1] for p in pairs}


def capacity(acc: dict[int, float], threshold: float = 0.9) -> int:
    """The largest pair count up to which accuracy stays >= threshold (0 if even the smallest fails)."""
    best = 0
    for p in sorted(acc):
        if acc[p] < threshold:
            break
        best = p
    return best


def state_floats(mixer: str, size: Size) -> str:
    per_layer = size.heads * size.head_dim * size.head_dim
    if mixer == "softmax":
        return f"KV cache: {2 * size.width}·T"
    if mixer == "kda+mla":
        mla = size.layers // 4
        return f"{(size.layers - mla) * per_layer:,} + latent cache {mla * size.width // 2}·T"
    return f"{size.layers * per_layer:,}"


def judge(scores: dict[str, dict[int, float]], head_dim: int) -> list[Claim]:
    """The article's recall claims, judged on accuracies (thresholds stated in each measured cell). A claim about a
    mixer that did not learn the task at all (< 50% with the fewest pairs) is not measurable in this budget."""
    pairs = sorted(next(iter(scores.values())))
    small, large = pairs[0], pairs[-1]
    over = [p for p in pairs if p > head_dim] or [large]

    def mean_over(m):
        return sum(scores[m][p] for p in over) / len(over)

    def learned(*mixers):
        return all(scores[m][small] >= 0.5 for m in mixers)

    def verdict(ok: bool, strong: bool, weak: bool) -> str:
        return "not measurable here" if not ok else "holds" if strong else "partly" if weak else "does not hold"

    claims = []
    if "linear_attn" in scores:
        lin = scores["linear_attn"]
        drop = lin[small] - lin[large]
        best_large = max(scores[m][large] for m in scores)
        claims.append(Claim(
            "Linear attention adds every pair into one D×D state: past its capacity (N ≫ D) associations interfere",
            f"linear attention: {lin[small]:.0%} at {small} pair(s) → {lin[large]:.0%} at {large} (D = {head_dim}); "
            f"best mixer at {large}: {best_large:.0%} (holds if the drop is ≥ 20 points and ≥ 10 below the best)",
            verdict(learned("linear_attn"), drop >= 0.2 and best_large - lin[large] >= 0.1, drop >= 0.1)))
    if {"deltanet", "linear_attn"} <= scores.keys():
        gain = mean_over("deltanet") - mean_over("linear_attn")
        claims.append(Claim(
            "The delta rule overwrites instead of piling up, so DeltaNet retrieves more past capacity",
            f"mean accuracy beyond D = {head_dim} pairs: DeltaNet {mean_over('deltanet'):.0%} vs linear attention "
            f"{mean_over('linear_attn'):.0%} (holds at ≥ +10 points, partly at ≥ +2)",
            verdict(learned("deltanet", "linear_attn"), gain >= 0.1, gain >= 0.02)))
    if {"kda+mla", "kda"} <= scores.keys():
        hybrid, kda = mean_over("kda+mla"), mean_over("kda")
        claims.append(Claim(
            "Periodic MLA layers restore exact retrieval: attention is the most effective selective read",
            f"mean accuracy beyond D = {head_dim} pairs: KDA+MLA {hybrid:.0%} vs KDA alone {kda:.0%} "
            f"(holds at ≥ +10 points or ≥ 90%, partly at ≥ +2)",
            verdict(learned("kda+mla"), hybrid - kda >= 0.1 or hybrid >= 0.9, hybrid - kda >= 0.02)))
    if "softmax" in scores:
        soft = scores["softmax"]
        claims.append(Claim(
            "Softmax attention keeps every token (its KV cache grows with T), so recall does not saturate",
            f"softmax attention: {soft[large]:.0%} at {large} pairs, {soft[small]:.0%} at {small} "
            f"(holds if ≥ 90% at {large} pairs, partly if within 10 points of its {small}-pair accuracy)",
            verdict(learned("softmax"), soft[large] >= 0.9, soft[large] >= soft[small] - 0.1)))
    return claims


def run(mode: str, docs: Path, **options) -> Result:
    plan = PLANS[mode]
    docs = Path(docs)
    runs = [(d, t) for d in plan.head_dims for t in plan.seq_lens]
    jobs = [(plan, m, d, t) for d, t in runs for m in reversed(MIXERS)]  # the slowest first
    accuracies = run_jobs(score_mixer, jobs, "k3 lab recall", workers=1 if mode == "smoke" else None,
                          show=mode != "smoke")
    scores: dict[tuple[int, int], dict[str, dict[int, float]]] = {run: {} for run in runs}
    for (_, m, d, t), acc in zip(jobs, accuracies):
        scores[d, t][m] = acc
    scores = {run: {m: s[m] for m in MIXERS} for run, s in scores.items()}

    tables, figures = [], []
    for head_dim, seq_len in runs:
        s = scores[head_dim, seq_len]
        pairs = sorted(next(iter(s.values())))
        size = Size(width=plan.width, layers=plan.layers, head_dim=head_dim, max_len=seq_len)
        tables.append(Table(
            f"MQAR query accuracy, T = {seq_len}, linear head state {head_dim}×{head_dim} ({size.heads} heads, "
            f"{plan.layers} layers, width {plan.width}, {plan.steps} steps)",
            ["mixer", "state floats"] + [f"{p} pairs" for p in pairs] + ["pairs at ≥ 90%"],
            [[LABELS[m], state_floats(m, size)] + [f"{s[m][p]:.0%}" for p in pairs] + [capacity(s[m])]
             for m in MIXERS]))
    path = "figures/recall.png"
    _plot(docs / path, plan, scores)
    figures.append(Figure(path, "MQAR accuracy against the number of key-value pairs, per mixer; the dashed line "
                                "marks pairs = D, a linear head's key dimension"))
    main = scores[runs[0]] if mode != "full" else scores[(plan.head_dims[len(plan.head_dims) // 2], plan.seq_lens[0])]
    main_d = runs[0][0] if mode != "full" else plan.head_dims[len(plan.head_dims) // 2]
    notes = [
        "Each model trains on one thread, two models side by side on a 2-core machine. "
        "Each model sees fresh random sequences every step (no example repeats) and is scored on 256 held-out "
        "sequences per cell; accuracy is exact-match of the argmax at each query.",
        "Softmax attention has learned positions and must learn a previous-token head before it can bind keys to "
        "values; the linear mixers' short convolution gives them that for free, so at a small step budget softmax "
        "can trail for a reason that has nothing to do with its memory.",
        f"Chance is 1/{VOCAB.num_values} = {1 / VOCAB.num_values:.1%}. A mixer below 50% even with the fewest "
        "pairs has not learned the task in this budget; claims that rest on it are marked 'not measurable here'. "
        "The quick budget (a few hundred steps) is far below Zoology's; `--full` trains 3000 steps per model.",
    ]
    return Result(name="recall", title="Associative recall against state size", mode=mode,
                  command=command("recall", mode), claims=judge(main, main_d), tables=tables, figures=figures,
                  notes=notes, setup={"plan": plan.__dict__, "vocab": VOCAB.__dict__},
                  data={"accuracy": {f"D={d},T={t}": v for (d, t), v in scores.items()}})


def _plot(path: Path, plan: Plan, scores) -> None:
    from .plots import figure

    with figure(path, ncols=len(plan.head_dims)) as (fig, axes):
        axes = axes if hasattr(axes, "__len__") else [axes]
        for ax, head_dim in zip(axes, plan.head_dims):
            for j, seq_len in enumerate(plan.seq_lens):
                s = scores[head_dim, seq_len]
                for i, m in enumerate(MIXERS):
                    pairs = sorted(s[m])
                    ax.plot(pairs, [s[m][p] for p in pairs], ["-o", "--s", ":^"][j % 3], color=f"C{i}",
                            label=LABELS[m] + (f" (T={seq_len})" if len(plan.seq_lens) > 1 else ""))
            ax.axvline(head_dim, color="grey", ls="--", lw=1)
            ax.set_title(f"state {head_dim}×{head_dim} per head")
            ax.set_xlabel("key-value pairs")
            ax.set_ylabel("query accuracy")
            ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
