"""What `k3 lab parts` writes, one section per part: the claims with their verdicts, the tables, the
notes and the figures, from what `situ` and `latent_moe` measured (AttnRes' section is
`report_attn_res`). Each section returns (claims, tables, figures, notes)."""

from __future__ import annotations

from pathlib import Path

from ...models import ModelConfig
from .. import plots
from ..report import Claim, Figure, Table
from ..text import paragraph
from .latent_moe import moe_flop_ratios, moe_flops, moe_verdict, routed_flops
from .situ import (
    ALMOST_3X,
    FUSED_HOLDS,
    FUSED_VARIANTS,
    ROUGHLY_3X,
    SHORT_ROUNDS,
    SITU_SLOWDOWN,
    SITU_VARIANTS,
    best_fused,
    situ_ratios,
    situ_verdicts,
)


# -- SiTU-GLU against SwiGLU -------------------------------------------------------------------------
def situ_part(
    docs: Path,
    times: dict,
    elementwise: dict,
    compiled: bool,
    compile_notes: list[str],
    compile_seconds: dict[str, float],
    ffn: tuple[int, int, int],
    rounds: int,
):
    """`times` from `time_activations` (which left `compile_notes` and `compile_seconds`), `elementwise`
    from `time_elementwise`, both at `ffn` = (tokens, width, hidden)."""
    tokens, dim, hidden = ffn
    ratios = situ_ratios(times)
    notes = list(compile_notes)
    if not compiled:
        notes.append(paragraph("parts", "no-compile"))
    rows = []
    for part in ("activation", "gated MLP"):
        for variant, (name, mode_) in SITU_VARIANTS.items():
            for pas in ("fwd", "fwd+bwd"):
                if (part, pas, variant) in ratios:
                    rows.append(
                        [
                            part,
                            VARIANT_LABELS[variant],
                            pas,
                            1e3 * times[(part, "swiglu", pas, mode_)],
                            1e3 * times[(part, name, pas, mode_)],
                            ratios[(part, pas, variant)],
                        ]
                    )
    tables = [
        Table(
            f"SiTU-GLU against SwiGLU: {tokens} tokens, width {dim}, hidden {hidden}, float32; each SiTU "
            "against SwiGLU run the same way (eager or compiled); best of "
            f"{SHORT_ROUNDS * rounds} (activation) or {rounds} (MLP) interleaved rounds",
            ["part", "SiTU", "pass", "SwiGLU ms", "SiTU ms", "SiTU / SwiGLU"],
            rows,
        )
    ]
    unfused, fused = situ_verdicts(ratios)
    best = best_fused(ratios)
    claims = [
        Claim(
            f'SiTU: "without a fused kernel, the new activation is almost {SITU_SLOWDOWN:g}x slower"',
            "the article's formula, op by op: " + _situ_measured(ratios, "unfused formula"),
            unfused,
        ),
        Claim(
            "SiTU: a fused kernel removes the slowdown (the article: it needs one)",
            "; ".join(
                f"{VARIANT_LABELS[v]}: " + _situ_measured(ratios, v)
                for v in FUSED_VARIANTS
                if ("activation", "fwd", v) in ratios
            )
            + (f" (the verdict: {VARIANT_LABELS[best]}, the faster)" if best else "no fused SiTU run here"),
            fused,
        ),
    ]
    if compile_seconds:
        notes.append(
            paragraph("parts", "compile-took", took=", ".join(f"{v:.0f} s ({k})" for k, v in compile_seconds.items()))
        )
    (lo, hi), (wide_lo, wide_hi) = ALMOST_3X, ROUGHLY_3X
    notes += [
        paragraph("parts", "situs"),
        paragraph(
            "parts",
            "situ-verdicts",
            slowdown=SITU_SLOWDOWN,
            lo=lo,
            hi=hi,
            wide_lo=wide_lo,
            wide_hi=wide_hi,
            fused_holds=FUSED_HOLDS,
        ),
        paragraph("parts", "cpu-vs-gpu"),
    ]
    tables.append(
        Table(
            f"What SiTU's parts cost here: f(gate) * up on [{tokens}, {hidden}], forward, ms, best "
            f"of {SHORT_ROUNDS * rounds} rounds (SiTU computes two tanh and a sigmoid per element, "
            "SwiGLU one SiLU)",
            ["f", "eager ms", "compiled ms"],
            [
                [
                    name,
                    1e3 * elementwise[(name, "eager")],
                    1e3 * elementwise[(name, "compiled")] if (name, "compiled") in elementwise else "-",
                ]
                for name in ("tanh", "sigmoid", "silu")
            ],
        )
    )
    _situ_figure(docs / "figures" / "parts_situ.png", ratios)
    figures = [
        Figure(
            "figures/parts_situ.png",
            "SiTU-GLU time / SwiGLU time: the article's formula op by op "
            "(unfused), k3's fused autograd function, and the formula "
            "torch.compile'd; the dashed line is the article's 3x",
        )
    ]
    return claims, tables, figures, notes


VARIANT_LABELS = {
    "unfused formula": "unfused formula (eager)",
    "k3 fused": "k3 fused situ (eager)",
    "torch.compile": "formula, torch.compile",
}


def _situ_measured(ratios: dict[tuple[str, str, str], float], variant: str) -> str:
    """'activation 3.1x (fwd), 2.5x (fwd+bwd); gated MLP ...' for the ratios of `variant`."""
    parts = []
    for part in ("activation", "gated MLP"):
        got = [
            f"{ratios[(part, pas, variant)]:.2f}x ({pas})"
            for pas in ("fwd", "fwd+bwd")
            if (part, pas, variant) in ratios
        ]
        if got:
            parts.append(f"{part} " + ", ".join(got))
    return "; ".join(parts) or "not run here"


def _situ_figure(path: Path, ratios: dict[tuple[str, str, str], float]) -> None:
    labels = [f"{part}\n{pas}" for part in ("activation", "gated MLP") for pas in ("fwd", "fwd+bwd")]
    keys = [(part, pas) for part in ("activation", "gated MLP") for pas in ("fwd", "fwd+bwd")]
    colors = {"unfused formula": "tab:red", "k3 fused": "tab:green", "torch.compile": "tab:blue"}
    with plots.figure(path, size=(7.5, 3.8)) as (fig, ax):
        width = 0.8 / len(SITU_VARIANTS)
        for j, variant in enumerate(SITU_VARIANTS):
            values = [ratios.get((part, pas, variant), float("nan")) for part, pas in keys]
            xs = [i + (j - (len(SITU_VARIANTS) - 1) / 2) * width for i in range(len(keys))]
            ax.bar(xs, values, width, label=VARIANT_LABELS[variant], color=colors[variant])
        ax.axhline(SITU_SLOWDOWN, ls="--", color="gray", label=f"article: ~{SITU_SLOWDOWN:g}x unfused")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(range(len(keys)), labels)
        ax.set_ylabel("SiTU time / SwiGLU time")
        ax.legend(fontsize=8)


# -- latent MoE against a full-width MoE -------------------------------------------------------------
def moe_part(docs: Path, k3: ModelConfig, moe_times: dict[str, float], m: dict, rounds: int):
    """FLOPs on paper at K3's size (`k3`), and `moe_times` from `time_moe` at the small size `m`."""
    args = (k3.hidden_size, k3.moe_intermediate_size, k3.num_experts, k3.num_experts_per_tok)
    k3_ratios = moe_flop_ratios(*args, k3.moe_latent_size, k3.num_shared_experts)
    k3_lat = moe_flops(*args, k3.moe_latent_size, k3.num_shared_experts)
    k3_full = moe_flops(*args, None, k3.num_shared_experts)
    tables = [
        Table(
            f"MoE FLOPs per token at K3's size (d {k3.hidden_size}, latent {k3.moe_latent_size}, expert width "
            f"{k3.moe_intermediate_size}, top-{k3.num_experts_per_tok} of {k3.num_experts}, {k3.num_shared_experts} "
            f"shared at full width), GFLOPs",
            ["component", "latent MoE (K3)", "full width", "latent / full"],
            [
                [
                    name,
                    k3_lat[name] / 1e9,
                    k3_full[name] / 1e9,
                    (k3_lat[name] / k3_full[name]) if k3_full[name] else "-",
                ]
                for name in k3_lat
            ]
            + [["MoE layer", sum(k3_lat.values()) / 1e9, sum(k3_full.values()) / 1e9, k3_ratios["MoE layer"]]],
        )
    ]
    small_args = (m["dim"], m["hidden"], m["experts"], m["top_k"])
    small_ratio = moe_flop_ratios(*small_args, m["latent"])["routed path"]
    moe_time_ratio = moe_times["latent"] / moe_times["full width"]
    tables.append(
        Table(
            f"MoE forward time at a small size with K3's proportions ({m['tokens']} tokens, d {m['dim']}, latent "
            f"{m['latent']}, expert width {m['hidden']}, top-{m['top_k']} of {m['experts']}, SiTU experts, no shared "
            f"experts), best of {rounds} interleaved rounds",
            ["variant", "ms", "routed-path GFLOPs (model)", "time ratio", "FLOP ratio"],
            [
                [
                    "full width",
                    1e3 * moe_times["full width"],
                    m["tokens"] * routed_flops(moe_flops(*small_args)) / 1e9,
                    1.0,
                    1.0,
                ],
                [
                    "latent",
                    1e3 * moe_times["latent"],
                    m["tokens"] * routed_flops(moe_flops(*small_args, m["latent"])) / 1e9,
                    moe_time_ratio,
                    small_ratio,
                ],
            ],
        )
    )
    path_ratio = k3_ratios["routed path"]
    claims = [
        Claim(
            'latent MoE: the experts run in a compressed latent space, which "nearly halves the FLOPs"',
            f"at K3's size the routed experts take {k3_ratios['routed experts']:.2f}x the full-width FLOPs, "
            f"{path_ratio:.2f}x with the latent down/up projections, {k3_ratios['MoE layer']:.2f}x for the whole "
            f"MoE layer (shared experts, router); measured time {moe_time_ratio:.2f}x at a small size "
            f"(FLOP model {small_ratio:.2f}x)",
            moe_verdict(path_ratio),
        )
    ]
    notes = [
        paragraph(
            "parts",
            "moe-verdict",
            latent_params=3 * k3.moe_latent_size * k3.moe_intermediate_size,
            full_params=3 * k3.hidden_size * k3.moe_intermediate_size,
        ),
        paragraph("parts", "moe-time"),
    ]
    _moe_figure(docs / "figures" / "parts_moe.png", k3_lat, k3_full, moe_times, small_ratio)
    figures = [
        Figure(
            "figures/parts_moe.png",
            "MoE FLOPs per token at K3's size, latent against full width "
            "(left); measured forward time at a small size (right)",
        )
    ]
    return claims, tables, figures, notes


def _moe_figure(
    path: Path, lat: dict[str, int], full: dict[str, int], times: dict[str, float], flop_ratio: float
) -> None:
    with plots.figure(path, ncols=2, size=(10.0, 3.8)) as (fig, axes):
        ax = axes[0]
        bottoms = [0.0, 0.0]
        for name in lat:
            values = [lat[name] / 1e9, full[name] / 1e9]
            ax.bar(["latent (K3)", "full width"], values, bottom=bottoms, label=name)
            bottoms = [b + v for b, v in zip(bottoms, values)]
        ax.set_ylabel("GFLOPs per token, one MoE layer")
        ax.set_title("K3 size, on paper")
        ax.legend(fontsize=8)
        ax = axes[1]
        ax.bar(["latent", "full width"], [1e3 * times["latent"], 1e3 * times["full width"]], color="tab:green")
        ax.plot(
            [0],
            [1e3 * times["full width"] * flop_ratio],
            "_",
            color="black",
            ms=60,
            mew=2,
            label="full width x FLOP ratio",
        )
        ax.set_ylabel("forward ms")
        ax.legend(fontsize=8)
        ax.set_title("small size, measured")
