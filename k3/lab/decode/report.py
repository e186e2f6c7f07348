"""What `k3 lab decode` writes: its claims with their verdicts, the tables, the notes (the method, the
models, what extrapolating to 1M tokens means) and the figure, from the measured latencies, bytes and
fits. The notes' words are k3/lab/templates/decode.md's."""

from __future__ import annotations

from pathlib import Path

from ...models import CausalLM
from .. import plots
from ..report import Claim, Figure, Table
from ..text import paragraph
from .measure import ALL_KDA, BASELINE, CLAIMED_CONTEXT, PROMPT, WIDTH, Sweep, expected_bytes

# verdict thresholds (stated in the notes)
CONSTANT_GROWTH = 1.5  # all-KDA latency at the longest N over the shortest: "constant" up to this factor
ON_FACTOR = 1.5  # a measured throughput ratio "reaches" 6x when it is >= 6 / ON_FACTOR


def _throughput_ratio(analysis: dict, name: str, N: int | None = None) -> float:
    """Tokens per second of `name` over gpt2-tiny's, measured at N (default: the longest) or, for N
    beyond the data, from the linear fits."""
    latency = analysis["latency"]
    N = analysis["longest"] if N is None else N
    if N in latency[name]:
        return latency[BASELINE][N] / latency[name][N]
    (a0, b0), (a1, b1) = analysis["fits"][BASELINE], analysis["fits"][name]
    return (a0 + b0 * N) / (a1 + b1 * N)


def _per_token(nbytes: dict[int, dict[str, int]], kind: str) -> float:
    """Bytes per added token of one layer type (its total over all layers of that type)."""
    Ns = sorted(nbytes)
    return (nbytes[Ns[-1]].get(kind, 0) - nbytes[Ns[0]].get(kind, 0)) / (Ns[-1] - Ns[0])


def claims(sweep: Sweep, models: dict, analysis: dict) -> list[Claim]:
    nbytes, latency, longest = analysis["nbytes"], analysis["latency"], analysis["longest"]
    shortest = min(sweep.lengths)
    cfg = models["kimi-linear-tiny"].config
    n_kda = cfg.layer_types.count("kda")
    kda_sizes = {nbytes["kimi-linear-tiny"][N]["kda"] // n_kda for N in sweep.lengths}
    mha_layers = models[BASELINE].config.num_layers
    mha_slope = _per_token(nbytes[BASELINE], "mha") / mha_layers
    mha_expected = 2 * models[BASELINE].config.hidden_size * 4
    kda_constant = len(kda_sizes) == 1
    out = [
        Claim(
            "KDA's decode state is constant while a KV cache grows O(N)",
            f"a KDA layer holds {min(kda_sizes):,} bytes at every N from {shortest:,} to {longest:,}"
            + ("" if kda_constant else f" (varies: {sorted(kda_sizes)})")
            + f"; an MHA layer grows {mha_slope:,.0f} bytes per token (2·H·d·4 = {mha_expected:,}): gpt2-tiny holds "
            f"{sum(nbytes[BASELINE][longest].values()) / 2**20:,.1f} MiB at {longest:,} tokens, kimi-linear-tiny "
            f"{sum(nbytes['kimi-linear-tiny'][longest].values()) / 2**20:,.1f} MiB",
            "holds"
            if kda_constant and mha_slope == mha_expected and analysis["exact"]
            else "partly"
            if kda_constant or mha_slope == mha_expected
            else "does not hold",
        )
    ]

    n_mla = cfg.layer_types.count("mla")
    mla_slope = _per_token(nbytes["kimi-linear-tiny"], "mla") / n_mla
    mla_expected = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    out.append(
        Claim(
            "MLA caches only the latent c and k_pe: kv_lora_rank + qk_rope_head_dim values per token per layer "
            "(512 + 64 = 576 at K3 size)",
            f"an MLA layer grows {mla_slope:,.0f} bytes per token = {mla_slope / 4:.0f} floats "
            f"({cfg.kv_lora_rank} + {cfg.qk_rope_head_dim}), against {mha_expected:,} "
            "for an MHA layer of the same width",
            "holds" if mla_slope == mla_expected else "does not hold",
        )
    )

    growth = {name: latency[name][longest] / latency[name][shortest] for name in models}
    a, b = analysis["fits"][BASELINE]
    share = b * longest / (a + b * longest)
    flat, linear = growth[ALL_KDA] <= CONSTANT_GROWTH, share >= 0.5
    out.append(
        Claim(
            "Each KV-cache decode step reads the whole cache, O(N) per token; KDA's step does not grow",
            f"from {shortest:,} to {longest:,} tokens the all-KDA model's step changes {growth[ALL_KDA]:.2f}x; "
            f"gpt2-tiny's {growth[BASELINE]:.1f}x, its N-proportional part {share:.0%} of the step at {longest:,}",
            "holds" if flat and linear else "partly" if flat or linear else "does not hold",
        )
    )

    ratio = {name: _throughput_ratio(analysis, name) for name in ("kimi-linear-tiny", "kimi-k3-tiny")}
    at_claim = {name: _throughput_ratio(analysis, name, CLAIMED_CONTEXT) for name in ratio}
    main = "kimi-linear-tiny"
    out.append(
        Claim(
            "Kimi Linear: up to 6× the decode throughput of full attention (at 1M tokens of context)",
            f"at {longest:,} tokens kimi-linear-tiny decodes {ratio[main]:.2f}x as many tokens/s as gpt2-tiny "
            f"(kimi-k3-tiny {ratio['kimi-k3-tiny']:.2f}x); the linear fits extrapolate to {at_claim[main]:.1f}x "
            f"({at_claim['kimi-k3-tiny']:.1f}x) at 1M",
            "holds"
            if ratio[main] >= 6 / ON_FACTOR
            else "partly"
            if ratio[main] > 1 or at_claim[main] >= 6 / ON_FACTOR
            else "does not hold",
        )
    )
    return out


def tables(sweep: Sweep, models: dict, analysis: dict) -> list[Table]:
    latency, nbytes = analysis["latency"], analysis["nbytes"]
    names = list(models)
    rows = [
        [f"{N:,}"]
        + [f"{latency[name][N] * 1e3:.3g}" for name in names]
        + [f"{sum(nbytes[name][N].values()) / 2**20:.3g}" for name in names]
        for N in sweep.lengths
    ]
    main = Table(
        "Per-token decode latency (ms, median) and cache size (MiB) against the context length N",
        ["N"] + [f"{name} ms" for name in names] + [f"{name} MiB" for name in names],
        rows,
    )

    rows = []
    for name, model in models.items():
        types = model.config.layer_types
        counts = ", ".join(f"{types.count(kind)} {kind.upper()}" for kind in ("mha", "mla", "kda") if kind in types)
        per_token = sum(_per_token(nbytes[name], kind) for kind in set(types))
        constant = sum(nbytes[name][min(sweep.lengths)].get(kind, 0) for kind in set(types) if kind == "kda")
        rows.append(
            [
                name,
                counts,
                f"{per_token:,.0f}",
                f"{constant:,}",
                "yes" if all(nbytes[name][N] == expected_bytes(model, N) for N in sweep.lengths) else "NO",
            ]
        )
    layout = Table(
        "Cache bytes by layer type (Cache.nbytes_by_type(held=True), float32): what grows per token and what stays",
        ["model", "layers", "bytes per token", "constant bytes (KDA states)", "equals the config's count at every N"],
        rows,
    )

    rows = []
    for name in names:
        a, b = analysis["fits"][name]
        rows.append(
            [
                name,
                f"{a * 1e3:.3g}",
                f"{b * 1e6 * 1024:.3g}",
                f"{_throughput_ratio(analysis, name):.2f}" if name != BASELINE else "1",
                f"{_throughput_ratio(analysis, name, CLAIMED_CONTEXT):.1f}" if name != BASELINE else "1",
            ]
        )
    fit = Table(
        f"Latency ≈ a + b·N, fitted on N = {analysis['fit_from'][0]:,}-{analysis['fit_from'][-1]:,}; "
        f"throughput relative to gpt2-tiny, measured at {analysis['longest']:,} and extrapolated to 1M",
        [
            "model",
            "a (ms)",
            "b (µs per 1K tokens)",
            f"throughput ratio at {analysis['longest']:,}",
            "extrapolated at 1M",
        ],
        rows,
    )

    check = analysis["check"]
    rows = [
        [
            name,
            f"{c['bytes']:,}",
            f"{c['prefilled'] * 1e3:.3g}",
            f"{c['filled'] * 1e3:.3g}",
            f"{c['filled'] / c['prefilled']:.2f}",
        ]
        for name, c in check.items()
    ]
    method = Table(
        f"The method check at N = {sweep.check_length:,}: decode from a real prefill against decode "
        "from a filled cache (same layout and bytes, asserted)",
        ["model", "cache bytes", "prefilled ms", "filled ms", "filled / prefilled"],
        rows,
    )
    return [main, layout, fit, method]


def _describe(model: CausalLM) -> str:
    c = model.config
    kinds = ", ".join(
        f"{c.layer_types.count(kind)} {kind.upper()}" for kind in ("mha", "kda", "mla") if kind in c.layer_types
    )
    ffn = "latent MoE" if c.moe_latent_size else "MoE" if "moe" in c.mlp_types else "dense MLP"
    return f"{c.num_layers} layers ({kinds}; {ffn}{', AttnRes' if c.attn_res_block_size else ''})"


def notes(sweep: Sweep, models: dict, analysis: dict) -> list[str]:
    check, latency = analysis["check"], analysis["latency"]
    shortest, longest = min(sweep.lengths), analysis["longest"]
    ratios = [c["filled"] / c["prefilled"] for c in check.values()]
    main = "kimi-linear-tiny"
    (a0, b0), (a1, b1) = analysis["fits"][BASELINE], analysis["fits"][main]
    asymptote = (
        paragraph("decode", "asymptote", ratio=b0 / b1) if b1 > 0 else paragraph("decode", "asymptote-unbounded")
    )
    per_token = {
        name: sum(_per_token(analysis["nbytes"][name], kind) for kind in set(models[name].config.layer_types))
        for name in (BASELINE, main)
    }
    start = latency[BASELINE][shortest] / latency[main][shortest]
    return [
        paragraph(
            "decode", "filled", prompt=PROMPT, check_length=sweep.check_length, low=min(ratios), high=max(ratios)
        ),
        paragraph(
            "decode",
            "models",
            width=WIDTH,
            described="; ".join(f"{name}: {_describe(model)}" for name, model in models.items()),
        ),
        paragraph(
            "decode",
            "extrapolation",
            shortest=shortest,
            start=start,
            a_gpt2=a0 * 1e3,
            a_kimi=a1 * 1e3,
            at_claimed=_throughput_ratio(analysis, main, CLAIMED_CONTEXT),
            asymptote=asymptote,
            bytes_gpt2=per_token[BASELINE],
            bytes_kimi=per_token[main],
            bytes_ratio=per_token[BASELINE] / per_token[main],
            beyond=CLAIMED_CONTEXT / longest,
            gpt2_gib=per_token[BASELINE] * CLAIMED_CONTEXT / 2**30,
        ),
        paragraph("decode", "append"),
        paragraph("decode", "verdicts", constant_growth=CONSTANT_GROWTH, on_factor=ON_FACTOR, needed=6 / ON_FACTOR),
        paragraph("decode", "latency"),
    ]


def figure(docs: Path, sweep: Sweep, models: dict, analysis: dict) -> Figure:
    latency, nbytes = analysis["latency"], analysis["nbytes"]
    Ns = list(sweep.lengths)
    with plots.figure(docs / "figures" / "decode.png", ncols=3) as (fig, axes):
        lat, mem, ratio = axes
        for i, name in enumerate(models):
            lat.plot(Ns, [latency[name][N] * 1e3 for N in Ns], "o-", color=f"C{i}", label=name)
            mem.plot(Ns, [sum(nbytes[name][N].values()) / 2**20 for N in Ns], "o-", color=f"C{i}", label=name)
        for ax, label in ((lat, "ms per token (median)"), (mem, "cache (MiB)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("context length N")
            ax.set_ylabel(label)
            ax.legend(fontsize=8)
        from matplotlib.ticker import ScalarFormatter

        lat.yaxis.set_major_formatter(ScalarFormatter())
        lat.set_title("decode latency, batch 1")
        mem.set_title("cache bytes")
        far = [N for N in (2**k for k in range(10, 21)) if N > max(Ns)] or [CLAIMED_CONTEXT]
        for i, name in enumerate(("kimi-linear-tiny", "kimi-k3-tiny"), start=1):
            ratio.plot(Ns, [_throughput_ratio(analysis, name, N) for N in Ns], "o-", color=f"C{i}", label=name)
            ratio.plot(
                [max(Ns)] + far,
                [_throughput_ratio(analysis, name, max(Ns))] + [_throughput_ratio(analysis, name, N) for N in far],
                "--",
                color=f"C{i}",
                alpha=0.6,
            )
        ratio.axhline(6, color="gray", linestyle=":", label="the article's 6x")
        ratio.axhline(1, color="black", linewidth=0.5)
        ratio.set_xscale("log", base=2)
        ratio.set_xlabel("context length N (dashed: extrapolated)")
        ratio.set_ylabel("throughput / gpt2-tiny's")
        ratio.set_title("decode throughput ratio")
        ratio.legend(fontsize=8)
    return Figure(
        "figures/decode.png",
        "Decode latency and cache bytes against context length (log-x), and the "
        "throughput ratio to gpt2-tiny, measured and extrapolated to 1M",
    )
