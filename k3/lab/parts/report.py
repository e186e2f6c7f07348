"""What `k3 lab parts` writes, one section per part: the claims with their verdicts, the tables, the
notes and the figures, from what `situ`, `latent_moe` and `attn_res` measured. Each section returns
(claims, tables, figures, notes)."""

from __future__ import annotations

from pathlib import Path

from ...models import ModelConfig
from ...models.model import attn_res_source_counts
from ...models.params import count_params
from .. import plots
from ..report import Claim, Figure, Table
from .attn_res import ATTN_RES_LATENCY, PHASES, attn_res_flops, attn_res_verdict
from .latent_moe import moe_flop_ratios, moe_flops, moe_verdict, routed_flops
from .situ import SHORT_ROUNDS, SITU_SLOWDOWN, situ_ratios, situ_verdicts


# -- SiTU-GLU against SwiGLU -------------------------------------------------------------------------
def situ_part(docs: Path, times: dict, elementwise: dict, compiled: bool, compile_notes: list[str],
              compile_seconds: dict[str, float], ffn: tuple[int, int, int], rounds: int):
    """`times` from `time_activations` (which left `compile_notes` and `compile_seconds`), `elementwise`
    from `time_elementwise`, both at `ffn` = (tokens, width, hidden)."""
    tokens, dim, hidden = ffn
    ratios = situ_ratios(times)
    notes = list(compile_notes)
    if not compiled:
        notes.append("smoke mode skips torch.compile (it takes tens of seconds): no compiled figures")
    rows = []
    for part in ("activation", "gated MLP"):
        for mode_ in ("eager", "compiled"):
            for pas in ("fwd", "fwd+bwd"):
                if (part, pas, mode_) in ratios:
                    rows.append([part, mode_, pas, 1e3 * times[(part, "swiglu", pas, mode_)],
                                 1e3 * times[(part, "situ", pas, mode_)], ratios[(part, pas, mode_)]])
    tables = [Table(f"SiTU-GLU against SwiGLU: {tokens} tokens, width {dim}, hidden {hidden}, float32; best of "
                    f"{SHORT_ROUNDS * rounds} (activation) or {rounds} (MLP) interleaved rounds",
                    ["part", "mode", "pass", "SwiGLU ms", "SiTU ms", "SiTU / SwiGLU"], rows)]
    unfused, fused = situ_verdicts(ratios)
    claims = [Claim(f"SiTU: \"without a fused kernel, the new activation is almost {SITU_SLOWDOWN:g}x slower\"",
                    _situ_measured(ratios, "eager"), unfused),
              Claim("SiTU: a fused kernel removes the slowdown (the article: it needs one)",
                    _situ_measured(ratios, "compiled"), fused)]
    if compile_seconds:
        notes.append("torch.compile took " + ", ".join(f"{v:.0f} s ({k})" for k, v in compile_seconds.items())
                     + ": compiled once per variant, before the timing")
    notes.append(f"SiTU verdicts: \"almost {SITU_SLOWDOWN:g}x\" holds when the eager activation forward is "
                 "2-4x slower than SwiGLU's (partly: 1.5-6x); the fused claim holds when the compiled "
                 "slowdown is <= 1.5x and its excess over 1x at most half the eager one's (partly: when it only "
                 "shrinks). In the whole MLP the three matmuls dilute the activation's cost")
    notes.append("Why fusing helps less on a CPU than on a GPU: on a GPU these elementwise ops are memory-bound, "
                 "so one fused pass costs about what SwiGLU's does; on a CPU core they are compute-bound, and "
                 "SiTU evaluates two tanh and a sigmoid per element where SiLU evaluates one sigmoid, which no "
                 "fusion removes (the table of f(gate) * up: what one tanh costs against one sigmoid here)")
    tables.append(Table(f"What SiTU's parts cost here: f(gate) * up on [{tokens}, {hidden}], forward, ms, best "
                        f"of {SHORT_ROUNDS * rounds} rounds (SiTU computes two tanh and a sigmoid per element, "
                        "SwiGLU one SiLU)",
                        ["f", "eager ms", "compiled ms"],
                        [[name, 1e3 * elementwise[(name, "eager")],
                          1e3 * elementwise[(name, "compiled")] if (name, "compiled") in elementwise else "-"]
                         for name in ("tanh", "sigmoid", "silu")]))
    _situ_figure(docs / "figures" / "parts_situ.png", ratios)
    figures = [Figure("figures/parts_situ.png", "SiTU-GLU time / SwiGLU time, eager and torch.compile'd "
                                                "(fused); the dashed line is the article's 3x")]
    return claims, tables, figures, notes


def _situ_measured(ratios: dict[tuple[str, str, str], float], mode: str) -> str:
    """'activation 3.1x (fwd), 2.5x (fwd+bwd); gated MLP ...' for the ratios measured in `mode`."""
    parts = []
    for part in ("activation", "gated MLP"):
        got = [f"{ratios[(part, pas, mode)]:.2f}x ({pas})" for pas in ("fwd", "fwd+bwd") if (part, pas, mode) in ratios]
        if got:
            parts.append(f"{mode} {part} " + ", ".join(got))
    return "; ".join(parts) or "torch.compile not run here"


def _situ_figure(path: Path, ratios: dict[tuple[str, str, str], float]) -> None:
    labels = [f"{part}\n{pas}" for part in ("activation", "gated MLP") for pas in ("fwd", "fwd+bwd")]
    keys = [(part, pas) for part in ("activation", "gated MLP") for pas in ("fwd", "fwd+bwd")]
    with plots.figure(path, size=(7.0, 3.8)) as (fig, ax):
        width = 0.38
        for j, (mode, color) in enumerate((("eager", "tab:red"), ("compiled", "tab:blue"))):
            values = [ratios.get((part, pas, mode), float("nan")) for part, pas in keys]
            xs = [i + (j - 0.5) * width for i in range(len(keys))]
            ax.bar(xs, values, width, label=mode if mode == "eager" else "torch.compile (fused)", color=color)
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
    tables = [Table(
        f"MoE FLOPs per token at K3's size (d {k3.hidden_size}, latent {k3.moe_latent_size}, expert width "
        f"{k3.moe_intermediate_size}, top-{k3.num_experts_per_tok} of {k3.num_experts}, {k3.num_shared_experts} "
        f"shared at full width), GFLOPs", ["component", "latent MoE (K3)", "full width", "latent / full"],
        [[name, k3_lat[name] / 1e9, k3_full[name] / 1e9,
          (k3_lat[name] / k3_full[name]) if k3_full[name] else "-"] for name in k3_lat]
        + [["MoE layer", sum(k3_lat.values()) / 1e9, sum(k3_full.values()) / 1e9, k3_ratios["MoE layer"]]])]
    small_args = (m["dim"], m["hidden"], m["experts"], m["top_k"])
    small_ratio = moe_flop_ratios(*small_args, m["latent"])["routed path"]
    moe_time_ratio = moe_times["latent"] / moe_times["full width"]
    tables.append(Table(
        f"MoE forward time at a small size with K3's proportions ({m['tokens']} tokens, d {m['dim']}, latent "
        f"{m['latent']}, expert width {m['hidden']}, top-{m['top_k']} of {m['experts']}, SiTU experts, no shared "
        f"experts), best of {rounds} interleaved rounds",
        ["variant", "ms", "routed-path GFLOPs (model)", "time ratio", "FLOP ratio"],
        [["full width", 1e3 * moe_times["full width"],
          m["tokens"] * routed_flops(moe_flops(*small_args)) / 1e9, 1.0, 1.0],
         ["latent", 1e3 * moe_times["latent"],
          m["tokens"] * routed_flops(moe_flops(*small_args, m["latent"])) / 1e9,
          moe_time_ratio, small_ratio]]))
    path_ratio = k3_ratios["routed path"]
    claims = [Claim(
        "latent MoE: the experts run in a compressed latent space, which \"nearly halves the FLOPs\"",
        f"at K3's size the routed experts take {k3_ratios['routed experts']:.2f}x the full-width FLOPs, "
        f"{path_ratio:.2f}x with the latent down/up projections, {k3_ratios['MoE layer']:.2f}x for the whole "
        f"MoE layer (shared experts, router); measured time {moe_time_ratio:.2f}x at a small size "
        f"(FLOP model {small_ratio:.2f}x)", moe_verdict(path_ratio))]
    notes = ["MoE verdict: from the routed path's FLOP ratio at K3's size (experts + the latent projections "
             "that the latent space costs): holds <= 0.6, partly <= 0.8. The shared experts run at full "
             "width in the public config (the article draws them latent too), which is why the whole "
             "layer saves less. The latent MoE also halves every expert's parameters "
             f"({3 * k3.moe_latent_size * k3.moe_intermediate_size:,} instead of "
             f"{3 * k3.hidden_size * k3.moe_intermediate_size:,})",
             "The measured MoE time follows the FLOP ratio only roughly: k3 dispatches experts in a Python "
             "loop (one small matmul triple per used expert), whose fixed cost per expert is the same for "
             "both variants"]
    _moe_figure(docs / "figures" / "parts_moe.png", k3_lat, k3_full, moe_times, small_ratio)
    figures = [Figure("figures/parts_moe.png", "MoE FLOPs per token at K3's size, latent against full width "
                                               "(left); measured forward time at a small size (right)")]
    return claims, tables, figures, notes


def _moe_figure(path: Path, lat: dict[str, int], full: dict[str, int], times: dict[str, float],
                flop_ratio: float) -> None:
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
        ax.plot([0], [1e3 * times["full width"] * flop_ratio], "_", color="black", ms=60, mew=2,
                label="full width x FLOP ratio")
        ax.set_ylabel("forward ms")
        ax.legend(fontsize=8)
        ax.set_title("small size, measured")


# -- Block Attention Residuals on and off ------------------------------------------------------------
def attn_res_part(docs: Path, k3: ModelConfig, timed: list, sizes: dict, rounds: int):
    """`timed`: (config, `time_attn_res` result) per width of kimi-k3-tiny, the widest last; `sizes`: the
    mode's prefill and decode lengths."""
    measured = [(cfg, ar, {phase: ar[("on", phase)] / ar[("off", phase)] - 1 for phase in PHASES})
                for cfg, ar in timed]  # (config, times, overheads) per width
    tiny = measured[-1][0]
    tables = [Table(
        f"AttnRes on against off: kimi-k3-tiny ({tiny.num_layers} layers, block {tiny.attn_res_block_size}) at "
        f"width d, prefill of {sizes['prefill']} tokens, decode after {sizes['decode_prompt']} (mean of "
        f"{sizes['decode_steps']} steps), batch 1, best of {rounds} interleaved rounds",
        ["d", "phase", "off ms", "on ms", "overhead"],
        [[cfg.hidden_size, phase, 1e3 * ar[("off", phase)], 1e3 * ar[("on", phase)], f"{100 * over[phase]:+.1f}%"]
         for cfg, ar, over in measured for phase in PHASES])]
    paper = [(f"kimi-k3-tiny (d {cfg.hidden_size})", cfg) for cfg, _, _ in measured] + [("kimi-k3", k3)]
    rows = []
    for name, cfg in paper:
        on, off = count_params(cfg), count_params(cfg.replace(attn_res_block_size=None))
        rows.append([name, f"{off.total:,}", f"{on.total - off.total:,}",
                     f"{100 * (on.total - off.total) / on.total:.5f}%", f"{attn_res_flops(cfg):,}",
                     f"{100 * attn_res_flops(cfg) / (2 * on.active):.4f}%"])
    tables.append(Table(
        "AttnRes parameters and FLOPs per token on paper (~6·N·d FLOPs per mix over N sources, against "
        "2 x the active parameters of the model)",
        ["model", "parameters without", "AttnRes parameters", "share", "AttnRes FLOPs / token", "share of FLOPs"],
        rows))
    k3_on, k3_off = count_params(k3), count_params(k3.replace(attn_res_block_size=None))
    over = measured[-1][2]
    claims = [Claim(
        f"AttnRes \"adds roughly {100 * ATTN_RES_LATENCY:g}% inference latency\"",
        "; ".join(f"d {cfg.hidden_size}: prefill {100 * o['prefill']:+.1f}%, decode {100 * o['decode']:+.1f}%"
                  for cfg, _, o in measured)
        + f" (kimi-k3-tiny); on paper at K3's size {100 * attn_res_flops(k3) / (2 * k3_on.active):.3f}% of "
        f"the FLOPs and {100 * (k3_on.total - k3_off.total) / k3_on.total:.5f}% of the parameters",
        attn_res_verdict(list(over.values())))]
    notes = [f"AttnRes verdict: from the measured overheads of the widest model (d {tiny.hidden_size}, the "
             "closest to K3): holds when prefill and decode are both within +5%, partly within +15%. On paper "
             "AttnRes is a rounding error in FLOPs and parameters at K3's size; its latency is the extra "
             "small ops per sub-layer (a logit per source, a softmax over sources, a weighted sum reading "
             f"every block sum), which weigh more in a {tiny.num_layers}-layer model of width "
             f"{tiny.hidden_size} on a CPU than in K3's {k3.num_layers} layers of width {k3.hidden_size}"]
    _attn_res_figure(docs / "figures" / "parts_attnres.png", measured, k3)
    figures = [Figure("figures/parts_attnres.png", "AttnRes latency overhead in kimi-k3-tiny at several "
                                                   "widths (left); sources each K3 AttnRes mix reads (right)")]
    return claims, tables, figures, notes


def _attn_res_figure(path: Path, measured: list, k3: ModelConfig) -> None:
    with plots.figure(path, ncols=2, size=(10.0, 3.8)) as (fig, axes):
        ax = axes[0]
        width = 0.8 / len(PHASES)
        for j, phase in enumerate(PHASES):
            xs = [i + (j - (len(PHASES) - 1) / 2) * width for i in range(len(measured))]
            ax.bar(xs, [100 * over[phase] for _, _, over in measured], width, label=phase)
        ax.axhline(100 * ATTN_RES_LATENCY, ls="--", color="gray", label=f"article: +{100 * ATTN_RES_LATENCY:g}%")
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xticks(range(len(measured)), [f"d {cfg.hidden_size}" for cfg, _, _ in measured])
        ax.set_ylabel("latency overhead of AttnRes, %")
        ax.set_title("kimi-k3-tiny, measured")
        ax.legend(fontsize=8)
        ax = axes[1]
        counts = attn_res_source_counts(k3)
        ax.plot(range(len(counts)), counts, drawstyle="steps-post")
        ax.set_xlabel("AttnRes mix (2 per layer, then the final norm)")
        ax.set_ylabel("sources read")
        ax.set_title(f"K3: {k3.num_layers} layers, block {k3.attn_res_block_size}")
