"""What `k3 lab inspect` writes, one section per part of the model: AttnRes depth weights, expert load,
KDA decay, MLA attention. Each section turns the recorded statistics of the trained model (and of the
same architecture at initialisation) into a claim with its verdict, a table, a figure and a note, and
returns them as (claims, tables, figures, notes)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ...models import CausalLM
from .. import plots
from ..report import Claim, Figure, Table
from ..text import paragraph
from .recorder import Recorder
from .stats import (
    ATTN_RES_SELECTIVE,
    BALANCED,
    CHANNEL_SPREAD,
    HALF_LIFE_CAP,
    RETRIEVAL,
    attn_res_verdict,
    balance_verdict,
    channel_half_lives,
    channel_verdict,
    forgets,
    half_life,
    imbalance,
    retrieval_scores,
    retrieval_verdict,
    within_head_spread,
)


def attn_res_part(docs: Path, trained: Recorder, initial: Recorder):
    claim = (
        'AttnRes: each layer gives "more importance to whichever layers are most useful in context" '
        "instead of weighting all earlier outputs equally"
    )
    if not trained.attn_res:
        return [Claim(claim, "the model has no AttnRes", "not measurable here")], [], [], []
    mixes = list(trained.attn_res)
    weights = {m: (r["weights"] / r["tokens"]).tolist() for m, r in trained.attn_res.items()}
    entropy = {m: r["entropy"] / r["tokens"] for m, r in trained.attn_res.items()}
    width = max(len(w) for w in weights.values())
    rows = []
    grid = torch.full((len(mixes), width), float("nan"))
    for i, m in enumerate(mixes):
        w = weights[m]
        cols = [0] if len(w) == 1 else list(range(len(w) - 1)) + [width - 1]  # the partial sum goes last
        for col, value in zip(cols, w):
            grid[i, col] = value
        rows.append(
            [
                m,
                len(w),
                f"{w[0]:.2f}",
                f"{w[-1]:.2f}" if len(w) > 1 else "-",
                f"{entropy[m]:.2f}" if len(w) > 1 else "-",
            ]
        )
    multi = [entropy[m] for m in mixes if len(weights[m]) > 1]
    labels = ["embedding"] + [f"block {b}" for b in range(1, width - 1)] + ["partial sum"]
    path = docs / "figures" / "inspect_attnres.png"
    with plots.figure(path, size=(1.2 * width + 3.5, 0.32 * len(mixes) + 1.8)) as (fig, ax):
        im = ax.imshow(grid.numpy(), cmap="viridis", vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(width), labels, rotation=30, ha="right")
        ax.set_yticks(range(len(mixes)), mixes)
        for i in range(len(mixes)):
            for j in range(width):
                if not math.isnan(grid[i, j]):
                    ax.text(
                        j,
                        i,
                        f"{grid[i, j]:.2f}",
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white" if grid[i, j] < 0.5 else "black",
                    )
        ax.set_title("AttnRes weight per source, mean over tokens")
        fig.colorbar(im, ax=ax)
    init_multi = [r["entropy"] / r["tokens"] for r in initial.attn_res.values() if len(r["weights"]) > 1]
    median = sorted(multi)[len(multi) // 2] if multi else float("nan")
    measured = (
        (
            f"per-token weight entropy / log N: median {median:.2f} over {len(multi)} mixes (lowest "
            f"{min(multi):.2f}, highest {max(multi):.2f}); at initialisation "
            f"{sum(init_multi) / max(1, len(init_multi)):.2f} (uniform)"
        )
        if multi
        else "no mix has two sources"
    )
    table = Table(
        "AttnRes mixes: sources, mean weight of the embedding and of the current block's partial sum, "
        "per-token entropy / log N (1 = uniform)",
        ["mix", "sources", "embedding", "partial sum", "entropy / log N"],
        rows,
    )
    note = paragraph("inspect", "attnres-verdict", selective=ATTN_RES_SELECTIVE)
    return (
        [Claim(claim, measured, attn_res_verdict(multi))],
        [table],
        [
            Figure(
                "figures/inspect_attnres.png",
                "AttnRes depth weights: one row per mix (before attention, "
                "before the FFN, final), one column per source",
            )
        ],
        [note],
    )


def moe_part(docs: Path, trained: Recorder, initial: Recorder):
    claim = (
        "aux-loss-free balancing: the per-expert correction bias steers top-k selection so that experts "
        "get even load, without entering the weights"
    )
    if not trained.moe:
        return [Claim(claim, "the model has no MoE layers", "not measurable here")], [], [], []
    layers = list(trained.moe)
    rows, with_bias, without = [], [], []
    biases = {}
    for name in layers:
        rec = trained.moe[name]
        moe = _module(trained.model, name, "block_sparse_moe")
        biases[name] = moe.router.e_score_correction_bias.detach().clone()
        w, wo, init = imbalance(rec["with"]), imbalance(rec["without"]), imbalance(initial.moe[name]["with"])
        with_bias.append(w)
        without.append(wo)
        b = biases[name]
        rows.append(
            [
                name,
                f"{init:.2f}",
                f"{wo:.2f}",
                f"{w:.2f}",
                f"{b.min().item():+.3f}..{b.max().item():+.3f}",
                f"{int((rec['with'] == 0).sum())} / {len(rec['with'])}",
            ]
        )
    path = docs / "figures" / "inspect_moe.png"
    with plots.figure(path, ncols=2, nrows=len(layers), size=(10.0, 2.4 * len(layers) + 0.6)) as (fig, axes):
        for i, name in enumerate(layers):
            rec, E = trained.moe[name], len(trained.moe[name]["with"])
            ax = axes[2 * i]
            share = lambda load: (load.double() / load.sum()).numpy()  # noqa: E731
            ax.bar(range(E), share(rec["with"]), color="tab:blue", label="with the bias (as routed)")
            ax.plot(range(E), share(rec["without"]), "o", color="tab:red", ms=4, label="without the bias")
            ax.axhline(1 / E, ls="--", color="gray", lw=0.8)
            ax.set_ylabel(f"{name} load share")
            ax.set_title(
                f"{name}: max/mean {imbalance(rec['with']):.2f} with, {imbalance(rec['without']):.2f} without the bias",
                fontsize=9,
            )
            if i == 0:
                ax.legend(fontsize=7)
            ax = axes[2 * i + 1]
            ax.bar(range(E), biases[name].numpy(), color="tab:green")
            ax.axhline(0, color="black", lw=0.8)
            ax.set_ylabel("correction bias")
            if i == len(layers) - 1:
                axes[2 * i].set_xlabel("expert")
                ax.set_xlabel("expert")
    mean_w, mean_wo = sum(with_bias) / len(with_bias), sum(without) / len(without)
    measured = (
        f"expert load max/mean, mean over {len(layers)} MoE layers: {mean_w:.2f} with the bias, "
        f"{mean_wo:.2f} without it (same router), "
        f"{sum(imbalance(initial.moe[n]['with']) for n in layers) / len(layers):.2f} at initialisation"
    )
    table = Table(
        "Expert load per MoE layer on validation text: max/mean assignments (1 = even), the bias range, idle experts",
        ["layer", "init", "trained, without bias", "trained, with bias", "bias range", "experts with no tokens"],
        rows,
    )
    note = paragraph("inspect", "balance-verdict", balanced=BALANCED)
    return (
        [Claim(claim, measured, balance_verdict(with_bias, without))],
        [table],
        [
            Figure(
                "figures/inspect_moe.png",
                "Expert load per MoE layer with and without the aux-loss-free "
                "bias (left; dashed: even load) and the bias per expert (right)",
            )
        ],
        [note],
    )


def _module(model: CausalLM, layer: str, attr: str):
    return getattr(model.model.layers[int(layer[1:])], attr)


def kda_part(docs: Path, trained: Recorder, initial: Recorder):
    claim = "KDA forgets per channel: each key channel of each head has its own decay rate (fine-grained forgetting)"
    if not trained.kda:
        return [Claim(claim, "the model has no KDA layers", "not measurable here")], [], [], []
    layers = list(trained.kda)
    H, K = trained.kda[layers[0]]["g_sum"].shape
    rows, spreads, init_spreads, forgetting, init_forgetting, finite = [], [], [], 0, 0, []
    for name in layers:
        hl, init_hl = channel_half_lives(trained.kda[name]), channel_half_lives(initial.kda[name])
        heads, init_heads = forgets(hl), forgets(init_hl)
        spread, init_spread = within_head_spread(hl)[heads], within_head_spread(init_hl)[init_heads]
        spreads += spread.tolist()
        init_spreads += init_spread.tolist()
        forgetting += int(heads.sum())
        init_forgetting += int(init_heads.sum())
        finite += hl[hl < HALF_LIFE_CAP].tolist()
        tokens = half_life(torch.cat(trained.kda[name]["samples"]))
        p = torch.quantile(tokens, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64))
        below = hl[hl < HALF_LIFE_CAP]
        rows.append(
            [
                name,
                f"{int(heads.sum())} / {H} ({int(init_heads.sum())})",
                f"{int((hl < HALF_LIFE_CAP).sum())} / {H * K}",
                f"{_tokens(below.min().item())} .. {_tokens(below.max().item())}" if len(below) else "-",
                f"{_tokens(p[0].item())} / {_tokens(p[1].item())} / {_tokens(p[2].item())}",
                _median_text(spread),
                _median_text(init_spread),
            ]
        )
    path = docs / "figures" / "inspect_kda.png"
    size = (max(6.0, 0.18 * K + 3.0), 2.4 * (len(layers) + 1))
    with plots.figure(path, ncols=1, nrows=len(layers) + 1, size=size) as (fig, axes):
        for i, name in enumerate(layers):
            ax = axes[i]
            im = ax.imshow(
                channel_half_lives(trained.kda[name]).log10().numpy(),
                aspect="auto",
                cmap="magma",
                vmin=0,
                vmax=math.log10(HALF_LIFE_CAP),
            )
            ax.set_yticks(range(H), [f"head {h}" for h in range(H)])
            ax.set_title(f"{name}: log10 half-life (tokens) per head and key channel", fontsize=9)
            fig.colorbar(im, ax=ax)
        axes[-2].set_xlabel("key channel")
        ax = axes[-1]
        bins = torch.linspace(-1, math.log10(HALF_LIFE_CAP), 50)
        for name in layers:
            values = half_life(torch.cat(trained.kda[name]["samples"])).log10()
            ax.hist(values.numpy(), bins=bins.numpy(), histtype="step", label=f"{name} trained", density=True)
        init = half_life(torch.cat([torch.cat(initial.kda[n]["samples"]) for n in layers])).log10()
        ax.hist(
            init.numpy(),
            bins=bins.numpy(),
            histtype="stepfilled",
            alpha=0.25,
            color="gray",
            label="all layers at init",
            density=True,
        )
        ax.set_xlabel("log10 half-life (tokens) per token and channel")
        ax.set_ylabel("density")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    cap = f"{HALF_LIFE_CAP:.0e}".replace("+0", "")  # 1e6
    if spreads:
        measured = (
            f"{forgetting} of {H * len(layers)} heads forget within {cap} tokens ({init_forgetting} at "
            f"initialisation); their channels' half-lives span {_tokens(min(finite))} to "
            f"{_tokens(max(finite))} tokens, and within one such head the 90th/10th percentile ratio is "
            f"{_median(spreads):.1f}x (median over those heads; {_median_text(init_spreads)} at "
            "initialisation)"
        )
    else:
        measured = f"no head forgets within {cap} tokens"
    table = Table(
        "KDA decay per layer: half-life ln 2 / -g in tokens per (head, key channel) from its mean log "
        f"decay (>= {cap} = no forgetting: g rounds to 0 in float32). Heads that forget (at least one "
        "channel under the cap; at initialisation in brackets), channels that forget, their half-life "
        "range, per token and channel percentiles, and the within-head spread (p90/p10 over a head's "
        "channels, median over the heads that forget)",
        [
            "layer",
            "heads forgetting",
            "channels forgetting",
            "half-lives",
            "per token p10 / p50 / p90",
            "spread",
            "spread at init",
        ],
        rows,
    )
    note = paragraph("inspect", "kda-verdict", holds=CHANNEL_SPREAD[0], partly=CHANNEL_SPREAD[1])
    return (
        [Claim(claim, measured, channel_verdict(spreads))],
        [table],
        [
            Figure(
                "figures/inspect_kda.png",
                "KDA forget-gate half-lives per head and key channel (top, one "
                "panel per KDA layer) and their distribution over tokens (bottom)",
            )
        ],
        [note],
    )


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _median_text(values) -> str:
    values = values.tolist() if isinstance(values, torch.Tensor) else values
    return f"{_median(values):.1f}x" if values else "-"


def _tokens(n: float) -> str:
    if n >= HALF_LIFE_CAP:
        return f">={HALF_LIFE_CAP:.0e}"
    return f"{n:.3g}" if n < 1e4 else f"{n:.1e}"


def mla_part(docs: Path, attention: Recorder, tokenizer, ids: list[int], period: int):
    claim = (
        "MLA layers retrieve from the token context exactly (what KDA's fixed-size state must discard): "
        "on a word sequence said twice, heads attend back to the first copy"
    )
    if not attention.mla:
        return [Claim(claim, "the model has no MLA layers", "not measurable here")], [], [], []
    layers = list(attention.mla)
    H = attention.mla[layers[0]].shape[0]
    rows, best, uniform = [], (0.0, "", 0), 0.0
    for name in layers:
        scores = retrieval_scores(attention.mla[name], period)
        uniform = scores["uniform"][0].item()
        for h in range(H):
            back = max(scores["copy"][h].item(), scores["induction"][h].item())
            if back > best[0]:
                best = (back, name, h)
            rows.append(
                [
                    name,
                    h,
                    f"{scores['copy'][h].item():.3f}",
                    f"{scores['induction'][h].item():.3f}",
                    f"{scores['previous'][h].item():.3f}",
                    f"{uniform:.3f}",
                ]
            )
    labels = [tokenizer.decode([i]).replace("\n", "\\n") or "?" for i in ids]
    T = len(ids)
    path = docs / "figures" / "inspect_mla.png"
    with plots.figure(path, ncols=H, nrows=len(layers), size=(3.6 * H, 3.6 * len(layers))) as (fig, axes):
        from matplotlib.colors import PowerNorm

        for i, name in enumerate(layers):
            for h in range(H):
                ax = axes[i * H + h]
                ax.imshow(attention.mla[name][h].numpy(), cmap="Blues", norm=PowerNorm(0.5, vmin=0, vmax=1))
                ax.set_title(f"{name} head {h}", fontsize=9)
                if T <= 48:
                    ax.set_xticks(range(T), labels, rotation=90, fontsize=5)
                    ax.set_yticks(range(T), labels, fontsize=5)
                ax.axvline(period - 0.5, color="tab:red", lw=0.6)
                ax.axhline(period - 0.5, color="tab:red", lw=0.6)
    measured = (
        f"best head ({best[1]} head {best[2]}) puts {best[0]:.2f} of its attention, on average over the "
        f"second copy, on the matching token of the first copy or the one after it (uniform attention: "
        f"{uniform:.3f}); prompt of {T} tokens"
    )
    table = Table(
        f"MLA attention on a {T}-token prompt said twice (period {period}): mean attention of the "
        "second copy's tokens on the same token in the first copy, on the token after it (induction), "
        "on the previous token, and what uniform attention would give",
        ["layer", "head", "copy", "induction", "previous", "uniform"],
        rows,
    )
    note = paragraph("inspect", "mla-verdict", retrieval=RETRIEVAL)
    return (
        [Claim(claim, measured, retrieval_verdict(best[0], uniform))],
        [table],
        [
            Figure(
                "figures/inspect_mla.png",
                "MLA attention probabilities per layer and head on the sample "
                "prompt (rows: queries, columns: keys; square-root colour scale; "
                "red: where the second copy starts)",
            )
        ],
        [note],
    )
