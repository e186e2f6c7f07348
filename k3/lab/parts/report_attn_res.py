"""What `k3 lab parts` writes about Block Attention Residuals: the claim with its verdict, the tables, the
notes and the figure, from `time_attn_res` over the widths of one K3 block (`k3_block_config`) and the
fit of the overhead against the width (`fit_overhead`), carried to K3's width. Returns (claims, tables,
figures, notes) as the other sections of `report` do."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...models import ModelConfig
from ...models.decoder import attn_res_source_counts
from ...models.params import count_params
from .. import plots
from ..report import Claim, Figure, Table
from ..text import paragraph
from .attn_res import (
    ATTN_RES_LATENCY,
    BLOCK_ATTN_RES,
    BLOCK_EXPERTS,
    BLOCK_LAYERS,
    BLOCK_VOCAB,
    HOLDS_AT_MOST,
    K3_WIDTH,
    PARTLY_AT_MOST,
    PHASES,
    attn_res_flops,
    attn_res_verdict,
    fit_overhead,
    leave_one_out,
    mean_sources,
)


def attn_res_part(docs: Path, k3: ModelConfig, timed: list, sizes: dict, rounds: int):
    """`timed`: (config, `time_attn_res` result) per width of the K3 block, narrowest first; `sizes`: the
    mode's prefill and decode lengths."""
    widths = [cfg.hidden_size for cfg, _ in timed]
    fits = {
        phase: fit_overhead(widths, [ar[("on", phase)] for _, ar in timed], [ar[("off", phase)] for _, ar in timed])
        for phase in PHASES
    }
    at_k3 = {phase: fits[phase].overhead(K3_WIDTH) for phase in PHASES}
    spread = (
        {
            phase: leave_one_out(
                widths, [ar[("on", phase)] for _, ar in timed], [ar[("off", phase)] for _, ar in timed], K3_WIDTH
            )
            for phase in PHASES
        }
        if len(widths) >= 4
        else {}
    )
    measured = {phase: [ar[("on", phase)] / ar[("off", phase)] - 1 for _, ar in timed] for phase in PHASES}
    block = timed[-1][0]
    sources, k3_sources = mean_sources(block), mean_sources(k3)
    setting = (
        f"prefill of {sizes['prefill']} tokens, decode after {sizes['decode_prompt']} (mean of "
        f"{sizes['decode_steps']} steps), batch 1, float32, one thread, best of {rounds} interleaved rounds"
    )
    rows = [
        [w]
        + [
            x
            for phase in PHASES
            for x in (1e3 * ar[("off", phase)], 1e3 * ar[("on", phase)], f"{100 * measured[phase][i]:+.1f}%")
        ]
        for i, (w, (_, ar)) in enumerate(zip(widths, timed))
    ]
    rows.append(
        [f"{K3_WIDTH:,} (fit, extrapolated)"]
        + [
            x
            for phase in PHASES
            for x in (
                1e3 * fits[phase].off_seconds(K3_WIDTH),
                1e3 * (fits[phase].off_seconds(K3_WIDTH) + fits[phase].extra_seconds(K3_WIDTH)),
                f"{100 * at_k3[phase]:+.1f}%",
            )
        ]
    )
    tables = [
        Table(
            f"AttnRes on against off in one K3 block ({BLOCK_LAYERS} layers at K3's proportions) of width d: "
            + setting,
            [
                "d",
                "prefill off ms",
                "prefill on ms",
                "prefill overhead",
                "decode off ms",
                "decode on ms",
                "decode overhead",
            ],
            rows,
        )
    ]
    tables.append(
        Table(
            "The fit per phase, seconds against width d: without AttnRes a + b·d + c·d² (a, b, c >= 0), what AttnRes "
            "adds p + q·d; the overhead (p + q·d) / (a + b·d + c·d²) at the widest width measured and at K3's",
            [
                "phase",
                "a (ms)",
                "b (ms per 1k d)",
                "c (ms per (1k d)²)",
                "p (ms)",
                "q (ms per 1k d)",
                f"fit at d {widths[-1]}",
                f"fit at d {K3_WIDTH:,} (extrapolated)",
                "leaving one width out",
            ],
            [
                [
                    phase,
                    1e3 * f.off[0],
                    1e6 * f.off[1],
                    1e9 * f.off[2],
                    1e3 * f.extra[0],
                    1e6 * f.extra[1],
                    f"{100 * f.overhead(widths[-1]):+.2f}%",
                    f"{100 * at_k3[phase]:+.2f}%",
                    _range(spread.get(phase)),
                ]
                for phase, f in fits.items()
            ],
        )
    )
    paper_rows = []
    for name, cfg in ((f"one K3 block (d {block.hidden_size})", block), ("kimi-k3", k3)):
        on, off = count_params(cfg), count_params(cfg.replace(attn_res_block_size=None))
        paper_rows.append(
            [
                name,
                f"{off.total:,}",
                f"{on.total - off.total:,}",
                f"{100 * (on.total - off.total) / on.total:.5f}%",
                f"{attn_res_flops(cfg):,}",
                f"{100 * attn_res_flops(cfg) / (2 * on.active):.4f}%",
            ]
        )
    tables.append(
        Table(
            "AttnRes parameters and FLOPs per token on paper (~6·N·d FLOPs per mix over N sources, against "
            "2 x the active parameters of the model)",
            ["model", "parameters without", "AttnRes parameters", "share", "AttnRes FLOPs / token", "share of FLOPs"],
            paper_rows,
        )
    )
    k3_on = count_params(k3)
    scale = k3_sources / sources
    claims = [
        Claim(
            f'AttnRes "adds roughly {100 * ATTN_RES_LATENCY:g}% inference latency"',
            f"one K3 block ({BLOCK_LAYERS} layers), measured at d {widths[0]}-{widths[-1]}: prefill "
            + ", ".join(f"{100 * o:+.1f}%" for o in measured["prefill"])
            + "; decode "
            + ", ".join(f"{100 * o:+.1f}%" for o in measured["decode"])
            + f". Fitted and extrapolated to K3's d {K3_WIDTH:,} (an extrapolation, {K3_WIDTH / widths[-1]:.1f}x past "
            f"the widest measured): prefill {100 * at_k3['prefill']:+.1f}%, decode {100 * at_k3['decode']:+.1f}%"
            + (
                f"; leaving one width out of the fit: prefill {_range(spread['prefill'])}, decode "
                f"{_range(spread['decode'])}"
                if spread
                else ""
            )
            + f"; if all of AttnRes' time grew with K3's {k3_sources:.1f} sources per mix against {sources:.1f} here: "
            f"prefill {100 * scale * at_k3['prefill']:+.1f}%, decode {100 * scale * at_k3['decode']:+.1f}%. On paper "
            f"at K3's size {100 * attn_res_flops(k3) / (2 * k3_on.active):.3f}% of the FLOPs",
            attn_res_verdict(list(at_k3.values())),
        )
    ]
    notes = [
        paragraph(
            "parts", "attnres-verdict", k3_width=K3_WIDTH, holds=100 * HOLDS_AT_MOST, partly=100 * PARTLY_AT_MOST
        ),
        paragraph("parts", "attnres-fit"),
        paragraph(
            "parts",
            "k3-block",
            k3_width=K3_WIDTH,
            experts=BLOCK_EXPERTS,
            block=BLOCK_ATTN_RES,
            sources=sources,
            k3_sources=k3_sources,
            vocab=BLOCK_VOCAB,
        ),
        paragraph("parts", "experts", experts=BLOCK_EXPERTS),
    ]
    _attn_res_figure(docs / "figures" / "parts_attnres.png", widths, measured, fits, k3)
    figures = [
        Figure(
            "figures/parts_attnres.png",
            "AttnRes latency overhead in one K3 block against width: "
            "measured (dots), fitted (line), extrapolated to K3's width "
            "(open marker) (left); sources each K3 AttnRes mix reads (right)",
        )
    ]
    return claims, tables, figures, notes


def _range(bounds: tuple[float, float] | None) -> str:
    return "-" if bounds is None else f"{100 * bounds[0]:+.1f}% to {100 * bounds[1]:+.1f}%"


def _attn_res_figure(path: Path, widths: list[int], measured: dict, fits: dict, k3: ModelConfig) -> None:
    with plots.figure(path, ncols=2, size=(10.0, 3.8)) as (fig, axes):
        ax = axes[0]
        inside = np.geomspace(widths[0], widths[-1], 100)
        beyond = np.geomspace(widths[-1], K3_WIDTH, 50)
        for phase, color in zip(PHASES, ("tab:blue", "tab:orange")):
            fit = fits[phase]
            ax.plot(widths, [100 * o for o in measured[phase]], "o", color=color, label=f"{phase}, measured")
            ax.plot(inside, [100 * fit.overhead(d) for d in inside], "-", color=color, label=f"{phase}, fit")
            ax.plot(beyond, [100 * fit.overhead(d) for d in beyond], ":", color=color)
            ax.plot([K3_WIDTH], [100 * fit.overhead(K3_WIDTH)], "o", mfc="none", color=color, ms=9)
        ax.axhline(100 * ATTN_RES_LATENCY, ls="--", color="gray", label=f"article: +{100 * ATTN_RES_LATENCY:g}%")
        ax.axhline(0, color="black", lw=0.8)
        ax.axvline(K3_WIDTH, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"width d (K3: {K3_WIDTH:,}, extrapolated)")
        ax.set_ylabel("latency overhead of AttnRes, %")
        ax.set_title(f"one K3 block ({BLOCK_LAYERS} layers)")
        ax.legend(fontsize=7)
        ax = axes[1]
        counts = attn_res_source_counts(k3)
        ax.plot(range(len(counts)), counts, drawstyle="steps-post")
        ax.set_xlabel("AttnRes mix (2 per layer, then the final norm)")
        ax.set_ylabel("sources read")
        ax.set_title(f"K3: {k3.num_layers} layers, block {k3.attn_res_block_size}")
