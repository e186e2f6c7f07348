"""Associative recall (MQAR, as in Zoology): can each mixer retrieve the value bound to a key, as the number of
key-value pairs grows past its state size?

The article: linear attention folds the history into a fixed D x D state, so "once the state exceeds its effective
capacity, associations begin to interfere because the update is additive and nothing leaves the cache"; DeltaNet's
delta rule overwrites instead of piling up; and in the hybrid "attention is the most effective selective-read
mechanism", restored by the periodic MLA layers.

Where the literature tests it: pair counts from D / 2 to 8 x D at two state sizes D (so capacity binds), keys
never repeated in a sequence, every model trained until its held-out accuracy stops improving
(`k3.lab.synthetic.train_until_plateau`) at each rate of a sweep, the best rate kept per cell (Zoology's
practice), the cells trained side by side in one-thread processes and kept as they finish (`k3.lab.cells`: a
stopped run resumes). Every mixer gets the same width, data and seed; Kimi's 3 KDA : 1 MLA cycle is set beside KDA
alone at its depth (4 layers), and the MLA layers' attention on the bound value shows whether attention is the
part that retrieves. Probe models (`PROBES`) test why it does not: MLA alone, softmax attention in its place, MLA
first, the KDA layers silent at the start, the KDA mixers frozen at their initial weights, and training only where
KDA's state cannot hold the pairs; the article's ELU+1 linear attention is trained beside the lab's.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..cells import Cells
from ..jobs import run_jobs
from ..report import Figure, Result, Table, command
from ..synthetic import DEPTH, LABELS, MIXERS, best_over_rates, mean_per_rate, mixer_config, rate_label
from ..text import paragraph
from .measure import best_head, filler_probe, mla_retrieval, score_mixer, stream_ratio
from .plan import (
    FAMILY,
    PLANS,
    PROBES,
    PUBLISHED_PLACE,
    SOFTMAX_HOLDS,
    Plan,
    _cell_from_json,
    _key,
    _plan_dict,
    cell_settings,
)
from .report import (
    LITERATURE,
    _plot,
    _plot_curves,
    _steps,
    capacity,
    disagreements,
    judge,
    judge_ordering,
    judge_retrieval,
    ordering_table,
    probe_table,
    retrieval_table,
    state_floats,
)

__all__ = [
    "FAMILY",
    "PLANS",
    "PROBES",
    "PUBLISHED_PLACE",
    "SOFTMAX_HOLDS",
    "Plan",
    "best_head",
    "capacity",
    "cell_settings",
    "disagreements",
    "filler_probe",
    "judge",
    "judge_ordering",
    "judge_retrieval",
    "mla_retrieval",
    "mixer_config",
    "ordering_table",
    "probe_table",
    "retrieval_table",
    "run",
    "score_mixer",
    "state_floats",
    "stream_ratio",
]


def run(mode: str, docs: Path, **options) -> Result:
    plan = PLANS[mode]
    docs = Path(docs)
    dims = sorted(plan.head_dims)
    main = dims[-1]  # the claims are judged at the largest state (quick mode's only one)
    # the costliest first: the largest state (the longest sequences), the deepest mixers
    mixers = sorted(plan.mixers, key=lambda m: -DEPTH.get(m, plan.layers))
    probe_rate = min(plan.lrs)
    jobs = [(plan, m, main, probe_rate, max(1, times * main)) for m, times in PROBES] if plan.probes else []
    jobs += [(plan, m, d, lr, 1) for d in reversed(dims) for m in mixers for lr in plan.lrs]
    # each finished cell is kept at once (`k3.lab.cells`): a stopped run resumes with the cells it lacks
    suffix = "-full" if mode == "full" else ""
    cells = Cells(docs / "lab" / f"recall{suffix}-cells", cell_settings(plan))
    found = {}
    for job in jobs:
        kept = cells.get(_key(job))
        if kept is not None:
            found[job[1:]] = _cell_from_json(kept)
    todo = [job for job in jobs if job[1:] not in found]
    if len(todo) < len(jobs) and mode != "smoke":
        print(
            f"k3 lab recall: {len(jobs) - len(todo)} of {len(jobs)} cells kept in {cells.folder}, {len(todo)} to train"
        )

    def keep(i: int, out: dict) -> None:
        cells.put(_key(todo[i]), out)
        found[todo[i][1:]] = _cell_from_json(json.loads(json.dumps(out)))

    run_jobs(
        score_mixer, todo, "k3 lab recall", workers=1 if mode == "smoke" else None, show=mode != "smoke", on_result=keep
    )
    probes = (
        {(m, times): found[m, main, probe_rate, max(1, times * main)] for m, times in PROBES} if plan.probes else {}
    )
    found = {(d, m, lr): out for (m, d, lr, train_from), out in found.items() if train_from == 1}
    scores, sweep, rate = {}, {}, {}
    for d in dims:
        for m in plan.mixers:
            by_rate = {lr: found[d, m, lr]["accuracy"] for lr in plan.lrs}
            scores[d, m], _ = best_over_rates(by_rate)
            sweep[d, m] = mean_per_rate(by_rate)
            rate[d, m] = max(plan.lrs, key=sweep[d, m].get)

    tables = []
    for d in dims:
        size, pairs = plan.size(d), plan.pairs(d)
        tables.append(
            Table(
                f"MQAR query accuracy, best over learning rates per cell (state {d}×{d} per linear head: "
                f"{size.heads} heads of width {plan.width}; T = 4 × pairs, no filler; each run trained until its "
                "held-out accuracy stopped improving, then decayed)",
                ["mixer", "state floats"] + [f"{p} pairs" for p in pairs] + ["pairs at ≥ 90%", "best rate", "steps"],
                [
                    [LABELS[m], state_floats(m, size)]
                    + [f"{scores[d, m][p]:.0%}" for p in pairs]
                    + [capacity(scores[d, m]), rate_label(rate[d, m]), _steps(found[d, m, rate[d, m]])]
                    for m in plan.mixers
                ],
            )
        )
        if len(plan.lrs) > 1:
            tables.append(
                Table(
                    f"The learning-rate sweep (state {d}×{d}): mean accuracy over the pair counts per rate",
                    ["mixer"] + [rate_label(lr) for lr in plan.lrs],
                    [[LABELS[m]] + [f"{sweep[d, m][lr]:.0%}" for lr in plan.lrs] for m in plan.mixers],
                )
            )
    _plot(docs / f"figures/recall{suffix}.png", plan, dims, scores)
    _plot_curves(
        docs / f"figures/recall-curves{suffix}.png", plan, main, {m: found[main, m, rate[main, m]] for m in plan.mixers}
    )
    main_scores = {m: scores[main, m] for m in plan.mixers}
    claims = judge(main_scores, main)
    hybrid, alone = ("3kda+mla", "4kda") if {"3kda+mla", "4kda"} <= set(plan.mixers) else ("kda+mla", "kda")
    retrieval = found[main, hybrid, rate[main, hybrid]]["retrieval"]
    claims.append(judge_retrieval(retrieval, main_scores[hybrid], main_scores[alone], (LABELS[hybrid], LABELS[alone])))
    if len(dims) > 1:
        means = {d: {m: sum(scores[d, m].values()) / len(scores[d, m]) for m in MIXERS} for d in dims}
        claims.append(judge_ordering(means))
        tables.append(ordering_table(means))
    tables.append(retrieval_table(plan, main, found, rate, scores))
    if probes:
        tables.append(probe_table(plan, main, probes, found[main, "3kda+mla", probe_rate], probe_rate))
    filler = {m: found[main, m, rate[main, m]]["filler"] for m in ("linear_attn", "deltanet") if m in plan.mixers}
    if filler:
        tables.append(
            Table(
                paragraph("recall", "filler-caption", d=main, short=4 * main, long=4 * plan.span * main),
                ["mixer", "no filler", "filler"],
                [[LABELS[m], f"{f['no filler']:.0%}", f"{f['filler']:.0%}"] for m, f in filler.items()],
            )
        )
    vocab = plan.vocab
    notes = [
        paragraph("recall", "setup", plan=plan, rates=", ".join(rate_label(lr) for lr in plan.lrs)),
        paragraph("recall", "convergence", plan=plan, plateau=plan.plateau),
        paragraph("recall", "task", plan=plan, vocab=vocab, chance=1 / vocab.num_values),
    ]
    notes += [paragraph("recall", name) for name in ("mixers", "gate", "learned")]
    timed = [out["seconds"] for out in list(found.values()) + list(probes.values()) if "seconds" in out]
    if timed:
        notes.append(paragraph("recall", "timed", timed=len(timed), cells=len(jobs), minutes=sum(timed) / 60))
    if len(todo) < len(jobs):
        notes.append(
            paragraph(
                "recall",
                "kept",
                kept=len(jobs) - len(todo),
                cells=len(jobs),
                folder=cells.folder.as_posix(),
                trained=len(todo),
            )
        )
    if mode == "full":
        notes += LITERATURE
    notes += disagreements(claims, main_scores, main, plan, probes, filler)
    title = "Associative recall against state size" + (", at scale" if mode == "full" else "")
    return Result(
        name="recall",
        title=title,
        mode=mode,
        command=command("recall", mode),
        claims=claims,
        tables=tables,
        figures=[
            Figure(
                f"figures/recall{suffix}.png",
                "MQAR accuracy (best learning rate per point) against the number of key-value "
                "pairs, per mixer and state size; the dashed line marks pairs = D, a linear "
                "head's key dimension",
            ),
            Figure(
                f"figures/recall-curves{suffix}.png",
                f"Held-out accuracy (mean over the pair counts) during training, each mixer's "
                f"best run at state {main}×{main}: the marker shows where the stable phase "
                "ended and the decay began",
            ),
        ],
        notes=notes,
        setup={"plan": _plan_dict(plan), "vocab": vocab.__dict__},
        data={
            "accuracy": {f"D={d}": {m: scores[d, m] for m in plan.mixers} for d in dims},
            "sweep": {
                f"D={d}": {m: {rate_label(lr): a for lr, a in sweep[d, m].items()} for m in plan.mixers} for d in dims
            },
            "runs": {
                f"D={d},{m},{rate_label(lr)}": {k: v for k, v in out.items() if k != "accuracy"}
                for (d, m, lr), out in found.items()
            },
        },
    )
