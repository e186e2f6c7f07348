"""Overwriting and forgetting: re-bound keys (the latest value must win) and context switches (what came before
must be dropped).

The article: linear attention can only add, so a re-bound key returns a blend of its old and new values; the delta
rule "can update a single fact but has no way to make the rest of the facts decay", so it "cannot efficiently clear
multiple associations during a context switch"; Gated DeltaNet's decay gate forgets, "all associations equally";
KDA's gate forgets per channel. One model per mixer and learning rate is trained on both tasks at once (a batch of
one task or the other each step), with equal width, depth, steps, data and seed, and scored on held-out sequences
per kind of query; each cell keeps its best learning rate (Zoology's practice; the recipe is `k3.lab.synthetic`'s).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .jobs import run_jobs
from .report import Claim, Figure, Result, Table, command
from .synthetic import (
    LABELS,
    MIXERS,
    Size,
    accuracy_by_kind,
    best_over_rates,
    mean_per_rate,
    mixer_config,
    rate_label,
    train_on_task,
)
from .tasks import Batch, Vocab, context_switch, overwrite
from .text import paragraph


@dataclass(frozen=True)
class Plan:
    pairs: int  # bindings before the re-binds / on each side of the switch
    rebound: int
    steps: int
    batch: int
    width: int = 64
    layers: int = 2
    head_dim: int = 8
    lrs: tuple[float, ...] = (5e-4, 1e-3, 3e-3)
    eval_batch: int = 256
    seed: int = 0

    @property
    def overwrite_len(self) -> int:
        return 4 * self.pairs + 2 * self.rebound  # bindings, re-binds, every key queried: no filler

    @property
    def switch_len(self) -> int:
        return 8 * self.pairs + 1  # A, SWITCH, B, then B's keys and up to as many stale ones queried


PLANS = {
    "smoke": Plan(pairs=4, rebound=2, steps=3, batch=8, width=16, head_dim=4, eval_batch=16),
    "quick": Plan(pairs=4, rebound=2, steps=500, batch=64),
    "full": Plan(pairs=12, rebound=6, steps=2000, batch=64, head_dim=16),
}
VOCAB = Vocab(num_keys=32, num_values=32)
COLUMNS = [
    ("overwrite", 1, "kept (bound once)"),
    ("overwrite", 2, "re-bound: latest value"),
    ("switch", 1, "after a switch: current"),
    ("switch", 2, "after a switch: stale → NONE"),
]


def _either(plan: Plan, g: torch.Generator) -> Batch:
    """One step's batch: re-binding or context-switch sequences, each at its own length, by a coin flip."""
    if int(torch.randint(2, (1,), generator=g)):
        return overwrite(plan.batch, plan.overwrite_len, plan.pairs, plan.rebound, VOCAB, generator=g)
    return context_switch(plan.batch, plan.switch_len, plan.pairs, VOCAB, generator=g)


def size_of(plan: Plan) -> Size:
    return Size(
        width=plan.width, layers=plan.layers, head_dim=plan.head_dim, max_len=max(plan.overwrite_len, plan.switch_len)
    )


def score_mixer(plan: Plan, mixer: str, lr: float) -> dict[str, float]:
    """Train one `mixer` model at `lr` on both tasks and return its accuracy per kind of query (held-out
    sequences)."""
    model, _ = train_on_task(
        mixer_config(mixer, VOCAB.size, size_of(plan)), lambda g: _either(plan, g), plan.steps, lr=lr, seed=plan.seed
    )
    test = torch.Generator().manual_seed(10_000 + plan.seed)
    acc = {
        "overwrite": accuracy_by_kind(
            model, overwrite(plan.eval_batch, plan.overwrite_len, plan.pairs, plan.rebound, VOCAB, generator=test)
        ),
        "switch": accuracy_by_kind(
            model, context_switch(plan.eval_batch, plan.switch_len, plan.pairs, VOCAB, generator=test)
        ),
    }
    return {label: acc[task].get(kind, float("nan")) for task, kind, label in COLUMNS}


def judge(scores: dict[str, dict[str, float]]) -> list[Claim]:
    """Verdicts from the accuracies; a claim resting on a mixer that did not learn the task (< 50% on keys bound
    once) is not measurable in this budget."""
    kept, rebound, current, stale = (label for _, _, label in COLUMNS)

    def verdict(mixers, gain: float, strong: float = 0.1, weak: float = 0.02) -> str:
        if any(scores[m][kept] < 0.5 for m in mixers):
            return "not measurable here"
        return "holds" if gain >= strong else "partly" if gain >= weak else "does not hold"

    claims = []
    if {"deltanet", "linear_attn"} <= scores.keys():
        d, lin = scores["deltanet"][rebound], scores["linear_attn"][rebound]
        claims.append(
            Claim(
                "Linear attention only adds, so a re-bound key recalls a blend; the delta rule replaces the old value",
                f"re-bound keys answered with the latest value: DeltaNet {d:.0%}, linear attention {lin:.0%} "
                "(holds at ≥ +10 points, partly at ≥ +2)",
                verdict(("deltanet", "linear_attn"), d - lin),
            )
        )
    if {"deltanet", "gated_deltanet", "kda"} <= scores.keys():
        d = scores["deltanet"][stale]
        gated = min(scores["gated_deltanet"][stale], scores["kda"][stale])
        claims.append(
            Claim(
                "The delta rule cannot clear many associations at a context switch; a decay gate forgets them",
                f"stale keys answered NONE after a switch: DeltaNet {d:.0%}, Gated DeltaNet "
                f"{scores['gated_deltanet'][stale]:.0%}, KDA {scores['kda'][stale]:.0%} (holds if both gated mixers "
                "beat DeltaNet by ≥ 10 points)",
                verdict(("deltanet", "gated_deltanet", "kda"), gated - d),
            )
        )
    if {"gated_deltanet", "kda"} <= scores.keys():

        def mean(m):
            return sum(scores[m].values()) / len(scores[m])

        claims.append(
            Claim(
                "KDA's per-channel gate forgets more finely than Gated DeltaNet's one scalar per head",
                f"mean accuracy over all four query kinds: KDA {mean('kda'):.0%}, Gated DeltaNet "
                f"{mean('gated_deltanet'):.0%} (holds at ≥ +10 points, partly at ≥ +2)",
                verdict(("gated_deltanet", "kda"), mean("kda") - mean("gated_deltanet")),
            )
        )
    return claims


def run(mode: str, docs: Path, **options) -> Result:
    plan = PLANS[mode]
    docs = Path(docs)
    jobs = [(plan, m, lr) for m in reversed(MIXERS) for lr in plan.lrs]  # the slowest first
    results = run_jobs(
        score_mixer, jobs, "k3 lab overwrite", workers=1 if mode == "smoke" else None, show=mode != "smoke"
    )
    found = {(m, lr): r for (_, m, lr), r in zip(jobs, results)}
    labels = [label for _, _, label in COLUMNS]
    scores, sweep = {}, {}
    for m in MIXERS:
        by_rate = {lr: found[m, lr] for lr in plan.lrs}
        scores[m], _ = best_over_rates(by_rate)
        sweep[m] = mean_per_rate(by_rate)
    table = Table(
        f"Query accuracy by kind, best over learning rates per cell ({plan.pairs} bindings, {plan.rebound} "
        f"re-bound, T = {plan.overwrite_len}; a switch between {plan.pairs} and {plan.pairs} bindings, T = "
        f"{plan.switch_len}; {plan.layers} layers, width {plan.width}, linear mixers' state "
        f"{size_of(plan).state_per_head()}; {plan.steps} steps of {plan.batch} sequences)",
        ["mixer"] + labels + ["best rate"],
        [
            [LABELS[m]] + [f"{scores[m][c]:.0%}" for c in labels] + [rate_label(max(sweep[m], key=sweep[m].get))]
            for m in MIXERS
        ],
    )
    sweep_table = Table(
        "The learning-rate sweep: mean accuracy over the four kinds of query per rate",
        ["mixer"] + [rate_label(lr) for lr in plan.lrs],
        [[LABELS[m]] + [f"{sweep[m][lr]:.0%}" for lr in plan.lrs] for m in MIXERS],
    )
    path = "figures/overwrite.png"
    _plot(docs / path, scores, labels)
    notes = [
        paragraph("overwrite", "training", rates=", ".join(rate_label(lr) for lr in plan.lrs)),
        paragraph("overwrite", "stale", num_values=VOCAB.num_values),
        paragraph("overwrite", "learned"),
    ]
    return Result(
        name="overwrite",
        title="Overwriting and forgetting",
        mode=mode,
        command=command("overwrite", mode),
        claims=judge(scores),
        tables=[table, sweep_table],
        figures=[
            Figure(
                path,
                "Accuracy per kind of query and mixer (best learning rate per bar): "
                "re-bound keys test overwriting, stale keys after a context switch test "
                "forgetting",
            )
        ],
        notes=notes,
        setup={"plan": plan.__dict__, "vocab": VOCAB.__dict__},
        data={"accuracy": scores, "sweep": {m: {rate_label(lr): a for lr, a in sweep[m].items()} for m in MIXERS}},
    )


def _plot(path: Path, scores: dict[str, dict[str, float]], labels: list[str]) -> None:
    from .plots import figure

    with figure(path, size=(9, 4)) as (fig, ax):
        width = 0.8 / len(MIXERS)
        for i, m in enumerate(MIXERS):
            xs = [j + (i - (len(MIXERS) - 1) / 2) * width for j in range(len(labels))]
            ax.bar(xs, [scores[m][c] for c in labels], width, label=LABELS[m], color=f"C{i}")
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set_ylabel("query accuracy")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7, ncols=3)
