"""What the recall sweep's numbers say: the claims and their verdicts, the tables, the paragraphs for each
disagreement with the literature, and the figures. The paragraphs' words are k3/lab/templates/recall.md's,
filled here from the run's own numbers."""

from __future__ import annotations

from pathlib import Path

from ..inspect.stats import RETRIEVAL, retrieval_verdict
from ..report import Claim, Table
from ..synthetic import DEPTH, LABELS, MIXERS, Size, hybrid_layers, rate_label
from ..text import paragraph
from .measure import best_head, stream_ratio
from .plan import FAMILY, PUBLISHED_PLACE, SOFTMAX_HOLDS, Plan


def capacity(acc: dict[int, float], threshold: float = 0.9) -> int:
    """The largest pair count up to which accuracy stays >= threshold (0 if even the smallest fails)."""
    best = 0
    for p in sorted(acc):
        if acc[p] < threshold:
            break
        best = p
    return best


def state_floats(mixer: str, size: Size) -> str:
    """The decode state a model of `mixer` keeps, in floats: the linear layers' D x D per head, MLA's latent
    cache and softmax attention's KV cache per token."""
    layers = hybrid_layers(DEPTH.get(mixer, size.layers)) if "mla" in mixer else [mixer] * DEPTH.get(mixer, size.layers)
    per_layer = size.heads * size.head_dim * size.head_dim
    if mixer == "softmax":
        return f"KV cache: {2 * size.width * size.layers}·T"
    linear = sum(kind != "mla" for kind in layers) * per_layer
    mla = layers.count("mla")
    return f"{linear:,}" + (f" + latent cache {mla * size.width // 2}·T" if mla else "")


def _verdict(ok: bool, strong: bool, weak: bool) -> str:
    return "not measurable here" if not ok else "holds" if strong else "partly" if weak else "does not hold"


def judge(scores: dict[str, dict[int, float]], head_dim: int) -> list[Claim]:
    """The article's recall claims, judged on accuracies at one state size D (thresholds stated in each measured
    cell, the issue's targets). A claim about a mixer that did not learn the task at all (< 50% with the fewest
    pairs) is not measurable in this budget."""
    pairs = sorted(next(iter(scores.values())))
    small, large = pairs[0], pairs[-1]
    over = [p for p in pairs if p > head_dim] or [large]

    def mean_over(m):
        return sum(scores[m][p] for p in over) / len(over)

    def learned(*mixers):
        return all(scores[m][small] >= 0.5 for m in mixers)

    claims = []
    soft = scores.get("softmax")
    if "linear_attn" in scores:
        lin = scores["linear_attn"]
        best = max(lin.values())
        drop = best - lin[large]
        softmax_holds = soft is not None and min(soft.values()) >= SOFTMAX_HOLDS
        shown = f"softmax attention at least {min(soft.values()):.0%} at every count" if soft else "no softmax run"
        claims.append(
            Claim(
                "Linear attention adds every pair into one D×D state: past its capacity (N ≫ D) associations interfere",
                f"linear attention: best {best:.0%} → {lin[large]:.0%} at {large} pairs (D = {head_dim}), a drop of "
                f"{drop * 100:.0f} points; {shown} (holds if the drop is ≥ 20 points while softmax attention stays "
                f"≥ {SOFTMAX_HOLDS:.0%}; partly at ≥ 10)",
                _verdict(learned("linear_attn"), drop >= 0.2 and softmax_holds, drop >= 0.1),
            )
        )
    if {"deltanet", "linear_attn"} <= scores.keys():
        gain = mean_over("deltanet") - mean_over("linear_attn")
        claims.append(
            Claim(
                "The delta rule overwrites instead of piling up, so DeltaNet retrieves more past capacity",
                f"mean accuracy beyond D = {head_dim} pairs: DeltaNet {mean_over('deltanet'):.0%} vs linear attention "
                f"{mean_over('linear_attn'):.0%} (holds at ≥ +10 points, partly at ≥ +2)",
                _verdict(learned("deltanet", "linear_attn"), gain >= 0.1, gain >= 0.02),
            )
        )
    hybrid, alone = ("3kda+mla", "4kda") if {"3kda+mla", "4kda"} <= scores.keys() else ("kda+mla", "kda")
    if {hybrid, alone} <= scores.keys():
        failing = [p for p in pairs if scores[alone][p] < 0.5] or [large]
        h = sum(scores[hybrid][p] for p in failing) / len(failing)
        k = sum(scores[alone][p] for p in failing) / len(failing)
        claims.append(
            Claim(
                "Periodic MLA layers restore exact retrieval: attention is the most effective selective read",
                f"{LABELS[hybrid]} {h:.0%} vs {LABELS[alone]} {k:.0%}, mean over the counts where the latter is below "
                f"50% ({', '.join(map(str, failing))} pairs; holds at ≥ +10 points or ≥ 90%, partly at ≥ +2)",
                _verdict(learned(hybrid), h - k >= 0.1 or h >= 0.9, h - k >= 0.02),
            )
        )
    if soft is not None:
        claims.append(
            Claim(
                "Softmax attention keeps every token (its KV cache grows with T), so recall does not saturate",
                f"softmax attention: {soft[large]:.0%} at {large} pairs, {soft[small]:.0%} at {small} "
                f"(holds if ≥ {SOFTMAX_HOLDS:.0%} at {large} pairs, partly if within 10 points of its {small}-pair "
                "accuracy)",
                _verdict(learned("softmax"), soft[large] >= SOFTMAX_HOLDS, soft[large] >= soft[small] - 0.1),
            )
        )
    return claims


def judge_ordering(means: dict[int, dict[str, float]]) -> Claim:
    """The literature's ordering, attention >= KDA+MLA hybrid >= DeltaNet family > linear attention, read off the
    mean accuracy over the pair counts at each state size `means` {D: {mixer: mean}}. Three relations per state
    size: softmax >= hybrid - 2 points, hybrid >= the best of the DeltaNet family - 2 points, and every member of
    the family >= linear attention + 5 points. Holds if all hold at every state size, partly if at least two
    thirds do."""
    relations, shown = [], []
    for d, m in sorted(means.items()):
        family = [m[f] for f in FAMILY]
        relations += [
            m["softmax"] >= m["kda+mla"] - 0.02,
            m["kda+mla"] >= max(family) - 0.02,
            min(family) >= m["linear_attn"] + 0.05,
        ]
        shown.append(
            f"state {d}×{d}: softmax {m['softmax']:.0%}, hybrid {m['kda+mla']:.0%}, DeltaNet family "
            f"{min(family):.0%}–{max(family):.0%}, linear {m['linear_attn']:.0%}"
        )
    met = sum(relations)
    verdict = "holds" if met == len(relations) else "partly" if 3 * met >= 2 * len(relations) else "does not hold"
    return Claim(
        "The published order on recall: attention ≥ KDA+MLA hybrid ≥ DeltaNet family > linear attention",
        "mean accuracy over the pair counts; " + "; ".join(shown) + f". {met} of {len(relations)} relations hold "
        "(≥ within 2 points, > by at least 5; holds if all do, partly if two thirds)",
        verdict,
    )


def judge_retrieval(
    retrieval: dict[int, dict],
    hybrid: dict[int, float],
    alone: dict[int, float],
    labels: tuple[str, str] = ("KDA+MLA hybrid", "KDA alone"),
) -> Claim:
    """ "MLA retrieves from the token context exactly", read off the hybrid's MLA heads where the KDA-only model
    at the same depth (`alone`) falls below 50% (the most pairs if it never does): the best head's attention on
    the value bound to the queried key, at the count where it is highest (the inspect section's threshold:
    holds at >= RETRIEVAL, partly at >= 3x uniform). `retrieval` {pairs: `mla_retrieval`}."""
    failing = [p for p in sorted(retrieval) if alone.get(p, 1.0) < 0.5] or [max(retrieval)]
    best, pairs, where = max(
        (a, p, (layer, head))
        for p in failing
        for layer, heads in enumerate(retrieval[p]["value"])
        for head, a in enumerate(heads)
    )
    uniform = retrieval[pairs]["uniform"]
    return Claim(
        "MLA layers retrieve from the token context exactly (what KDA's fixed-size state must discard)",
        f"in the {labels[0]} model trained on MQAR, at {pairs} pairs (where {labels[1]} is below 50%, or the most "
        "pairs): "
        f"its best MLA head (MLA layer {where[0]}, head {where[1]}) puts {best:.2f} of its attention on the value "
        f"bound to the queried key (uniform: {uniform:.3f}); the model answers {hybrid[pairs]:.0%}, {labels[1]} "
        f"{alone[pairs]:.0%} (holds at ≥ {RETRIEVAL} and ≥ 3× uniform, partly at ≥ 3× uniform)",
        retrieval_verdict(best, uniform) if best >= 3 * uniform else "does not hold",
    )


def _elu_probe(out: dict, under: list[int], over: list[int]) -> str:
    acc = out["accuracy"]
    return " " + paragraph(
        "recall", "elu-probe", under=sum(acc[p] for p in under) / len(under), over=sum(acc[p] for p in over) / len(over)
    )


def _filler_gap(filler: dict) -> str:
    d, lin = filler["deltanet"], filler["linear_attn"]
    return " " + paragraph(
        "recall",
        "filler-gap",
        pairs=d["pairs"],
        long=d["long"],
        delta_filler=d["filler"],
        linear_filler=lin["filler"],
        delta_plain=d["no filler"],
        linear_plain=lin["no filler"],
    )


def filler_note(filler: dict) -> str:
    """The filler probe's paragraph: each model's accuracy at D pairs without and with PAD filler."""
    f = next(iter(filler.values()))
    shown = "; ".join(
        paragraph("recall", "filler-model", label=LABELS[m], plain=x["no filler"], filler=x["filler"])
        for m, x in filler.items()
    )
    return paragraph("recall", "filler", pairs=f["pairs"], short=4 * f["pairs"], long=f["long"], shown=shown)


def disagreements(
    claims: list[Claim], scores: dict, head_dim: int, plan: Plan, probes: dict, filler: dict
) -> list[str]:
    """One paragraph for each claim whose verdict here contradicts a published result: the published setup, what
    differs here, and the measured probe that points at the cause (the numbers are this run's; the words are
    k3/lab/templates/recall.md's)."""
    notes = []
    verdicts = {c.claim.split(":")[0].split(",")[0]: c.verdict for c in claims}
    over = [p for p in plan.pairs(head_dim) if p > head_dim]
    under = [p for p in plan.pairs(head_dim) if p <= head_dim]

    def mean(mixer, counts):
        return sum(scores[mixer][p] for p in counts) / len(counts)

    if verdicts.get("The delta rule overwrites instead of piling up") not in (None, "holds") and under and over:
        notes.append(
            paragraph(
                "recall",
                "delta-disagreement",
                delta_under=mean("deltanet", under),
                linear_under=mean("linear_attn", under),
                delta_over=mean("deltanet", over),
                linear_over=mean("linear_attn", over),
            )
            + (_elu_probe(probes[("elu_linear_attn", 0)], under, over) if ("elu_linear_attn", 0) in probes else "")
            + (_filler_gap(filler) if {"deltanet", "linear_attn"} <= filler.keys() else "")
        )
    if filler:
        notes.append(filler_note(filler))
    retrieval_claim = next((c for c in claims if c.claim.startswith("MLA layers retrieve")), None)
    if probes and retrieval_claim is not None and retrieval_claim.verdict != "holds":
        notes.append(_mla_note(plan, head_dim, probes))
    return notes


def _mla_note(plan: Plan, head_dim: int, probes: dict) -> str:
    """The MLA-in-the-hybrid disagreement: what each probe's best head reads, and the cause the probes point at."""
    get = {m if not times else f"{m}@{times}": out for (m, times), out in probes.items()}
    fewest, most = min(plan.pairs(head_dim)), max(plan.pairs(head_dim))

    def head(key, pairs=most):
        return best_head(get[key]["retrieval"][pairs])

    def answers(key):
        acc = get[key]["accuracy"]
        return sum(acc.values()) / len(acc)

    def reads(key):
        """The best head on the bound value at the fewest and the most pairs, and the accuracy over the counts."""
        return paragraph(
            "recall",
            "mla-reads",
            fewest_head=head(key, fewest),
            fewest=fewest,
            most_head=head(key),
            most=most,
            answers=answers(key),
        )

    uniform = get["2mla"]["retrieval"][most]["uniform"]
    retrieves = {k: head(k) >= max(RETRIEVAL, 3 * uniform) for k, out in get.items() if "retrieval" in out}
    ratio, alone_ratio = stream_ratio("3kda+mla", plan, head_dim), stream_ratio("2mla", plan, head_dim)
    # MLA retrieves on the embeddings, no attention layer behind KDA layers does (probes all at hand)
    behind_kda_never = (
        retrieves["2mla"]
        and "frozen3kda+mla" in get
        and not any(retrieves[k] for k in ("3kda+mha", "3kda0+mla", "3kda+mla@2", "frozen3kda+mla"))
    )
    if retrieves.get("frozen3kda+mla") and not retrieves["3kda0+mla"]:
        cause = paragraph("recall", "cause-frozen-retrieves")
    elif retrieves["3kda0+mla"] and not retrieves["3kda+mha"]:
        cause = paragraph("recall", "cause-start")
    elif retrieves["3kda+mla@2"]:
        cause = paragraph("recall", "cause-order")
    elif behind_kda_never and answers("frozen3kda+mla") >= 0.05:
        cause = paragraph("recall", "cause-stream-frozen-answers", ratio=ratio, answers=answers("frozen3kda+mla"))
    elif behind_kda_never:
        cause = paragraph("recall", "cause-stream-frozen-nothing", ratio=ratio)
    else:
        cause = paragraph("recall", "cause-unknown")
    frozen = paragraph("recall", "mla-frozen", reads=reads("frozen3kda+mla")) if "frozen3kda+mla" in get else ""
    return (
        paragraph(
            "recall",
            "mla-disagreement",
            d=head_dim,
            uniform=uniform,
            most=most,
            mla_alone=reads("2mla"),
            mha_after=reads("3kda+mha"),
            mla_first=reads("mla+3kda"),
            from_pairs=2 * head_dim,
            from_twice=reads("3kda+mla@2"),
            zero_outputs=reads("3kda0+mla"),
            frozen=frozen,
            ratio=ratio,
            alone_ratio=alone_ratio,
        )
        + " "
        + cause
    )


def _steps(out: dict) -> str:
    """A run's steps as the table prints them: "1,380 (plateau)"."""
    return f"{out['steps']:,} ({out['stopped_by']})"


def probe_table(plan: Plan, head_dim: int, probes: dict, reference: dict, lr: float) -> Table:
    """The probes (`PROBES`) beside the 3:1 cycle at the same rate: accuracy per pair count, and at the most pairs
    the best attention head's share on the bound value against uniform attention's (– without attention)."""
    pairs = plan.pairs(head_dim)
    rows = []
    for (mixer, times), out in [(("3kda+mla", 0), reference)] + list(probes.items()):
        label = LABELS[mixer] + (f", trained from {times * head_dim} pairs up" if times else "")
        r = out.get("retrieval", {}).get(max(pairs))
        attention = [f"{best_head(r):.3f}", f"{r['uniform']:.3f}"] if r else ["–", "–"]
        rows.append([label] + [f"{out['accuracy'][p]:.0%}" for p in pairs] + attention + [_steps(out)])
    return Table(
        f"The probes: why the hybrid's MLA layer does or does not retrieve, and the article's linear "
        f"attention (state {head_dim}×{head_dim}, rate "
        f"{rate_label(lr)}): accuracy per pair count and, at {max(pairs)} pairs, the best attention head's "
        "mean attention on the bound value",
        ["model"] + [f"{p} pairs" for p in pairs] + ["best head on the bound value", "uniform", "steps"],
        rows,
    )


def retrieval_table(plan: Plan, head_dim: int, found: dict, rate: dict, scores: dict) -> Table:
    """Per pair count at state `head_dim`: each hybrid's best MLA head's attention on the bound value, what
    uniform attention puts there, and the accuracies of the hybrid and of KDA alone at its depth."""
    rows = []
    for hybrid, alone in (("kda+mla", "kda"), ("3kda+mla", "4kda")):
        if hybrid not in plan.mixers:
            continue
        retrieval = found[head_dim, hybrid, rate[head_dim, hybrid]]["retrieval"]
        for p, r in sorted(retrieval.items()):
            rows.append(
                [
                    LABELS[hybrid],
                    p,
                    f"{best_head(r):.3f}",
                    f"{r['uniform']:.3f}",
                    f"{scores[head_dim, hybrid][p]:.0%}",
                    f"{scores[head_dim, alone][p]:.0%}" if alone in plan.mixers else "–",
                ]
            )
    return Table(
        f"MLA attention in the hybrids (state {head_dim}×{head_dim}, each at its best rate): the best MLA "
        "head's mean attention from a query key on the value bound to it, per pair count",
        ["model", "pairs", "best head on the bound value", "uniform", "model accuracy", "KDA alone, same depth"],
        rows,
    )


LITERATURE = [paragraph("recall", "literature")]  # the published orderings the claims are set beside


def ordering_table(means: dict[int, dict[str, float]]) -> Table:
    """Mean accuracy over the pair counts per mixer and state size D, each mixer's rank at each D, and its place
    in the published order."""
    dims = sorted(means)
    ranks = {d: {m: 1 + sum(means[d][o] > means[d][m] for o in MIXERS) for m in MIXERS} for d in dims}
    return Table(
        "The order of the mixers: mean accuracy over the pair counts, the rank it gives at each state size, "
        "and the place the literature gives (1 best; the DeltaNet family shares place 3)",
        ["mixer"] + [f"state {d}×{d}" for d in dims] + [f"rank at {d}×{d}" for d in dims] + ["published place"],
        [
            [LABELS[m]] + [f"{means[d][m]:.0%}" for d in dims] + [ranks[d][m] for d in dims] + [PUBLISHED_PLACE[m]]
            for m in MIXERS
        ],
    )


def _plot(path: Path, plan: Plan, dims, scores) -> None:
    from ..plots import figure

    with figure(path, ncols=len(dims)) as (fig, axes):
        axes = axes if hasattr(axes, "__len__") else [axes]
        for ax, head_dim in zip(axes, dims):
            pairs = plan.pairs(head_dim)
            for i, m in enumerate(plan.mixers):
                s = scores[head_dim, m]
                ax.plot(pairs, [s[p] for p in pairs], "-o" if m in MIXERS else "--s", color=f"C{i}", label=LABELS[m])
            ax.axvline(head_dim, color="grey", ls="--", lw=1)
            ax.set_xscale("log", base=2)
            ax.set_title(f"state {head_dim}×{head_dim} per linear head, width {plan.width}")
            ax.set_xlabel("key-value pairs")
            ax.set_ylabel("query accuracy")
            ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)


def _plot_curves(path: Path, plan: Plan, head_dim: int, runs: dict[str, dict]) -> None:
    """Held-out accuracy against steps for each mixer's best run; a marker where the decay began."""
    from ..plots import figure

    with figure(path) as (fig, ax):
        for i, (m, out) in enumerate(runs.items()):
            steps, acc = zip(*out["curve"])
            ax.plot(steps, acc, "-" if m in MIXERS else "--", color=f"C{i}", label=LABELS[m])
            if out["stable"] in steps:
                ax.plot(out["stable"], acc[steps.index(out["stable"])], "o", color=f"C{i}")
        ax.set_title(f"held-out accuracy during training (state {head_dim}×{head_dim})")
        ax.set_xlabel("step")
        ax.set_ylabel("mean query accuracy over the pair counts")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
