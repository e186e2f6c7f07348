"""`k3 lab lineage`: the whole lineage on language modelling, at one width and one wall-clock budget.

The article's argument is that each architecture "adds capacity to address a concrete limitation in the
preceding system", and that Kimi Linear, "under controlled comparisons, outperformed full attention". Here
every lineage model trains on the demo corpus at the same width, with the same data, batch, optimizer and
schedule, for the same minutes each (one after the other, on all the machine's threads, as `k3 train` runs):

    GPT-2 -> linear attention -> DeltaNet -> Gated DeltaNet -> KDA -> Kimi Linear -> Kimi K3

(each `*-tiny` preset at its own depth, `hidden_size` set to kimi-k3-tiny's; KDA is gated-deltanet-tiny
with every mixer a KDA layer). The result: validation bits per byte against training tokens and against
training seconds (evaluations excluded), one plot each; the tokens each model saw; its parameters (total
and active); its decode state at 4,096 tokens (`k3.plan.serving.cache_bytes`, bf16); and its training
tokens/s measured side by side (one step of each in turn, best of a few rounds).
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from pathlib import Path

from ..models import CausalLM, count_params, get_config
from ..models.params import binary_bytes
from ..plan.serving import cache_bytes
from .plots import figure
from .report import Claim, Figure, Result, Table, command
from .text import paragraph

# name -> (preset, overrides beyond the width): the lineage in the article's order
LINEAGE: dict[str, tuple[str, dict]] = {
    "GPT-2": ("gpt2-tiny", {}),
    "linear attention": ("linear-attn-tiny", {}),
    "DeltaNet": ("deltanet-tiny", {}),
    "Gated DeltaNet": ("gated-deltanet-tiny", {}),
    "KDA": ("gated-deltanet-tiny", {"layer_types": ["kda"] * 4}),
    "Kimi Linear": ("kimi-linear-tiny", {}),
    "Kimi K3": ("kimi-k3-tiny", {}),
}
CHAIN = ("linear attention", "DeltaNet", "Gated DeltaNet", "KDA")  # the steps that add capacity to the state
HYBRIDS = ("Kimi Linear", "Kimi K3")
BETTER = 0.01  # bits per byte: a model is better than another when lower by at least this
DECODE_CONTEXT = 4096

SIZES = {  # per mode: the width, each model's minutes (None: `steps` steps), evaluations per run, eval tokens
    "smoke": dict(
        width=32, minutes=None, steps=4, evaluations=2, eval_tokens=2048, speed_rounds=1, overrides=dict(num_layers=2)
    ),
    "quick": dict(width=192, minutes=1.0, steps=None, evaluations=8, eval_tokens=16384, speed_rounds=3, overrides={}),
    "full": dict(width=192, minutes=10.0, steps=None, evaluations=12, eval_tokens=65536, speed_rounds=5, overrides={}),
}


def lineage_overrides(name: str, width: int, **overrides) -> dict:
    """The preset overrides of lineage model `name` at `width` (see LINEAGE), with `overrides` for every
    model (a `num_layers` keeps the model's own layer pattern at that depth)."""
    own = dict(LINEAGE[name][1])
    if "layer_types" in own and "num_layers" in overrides:
        own["layer_types"] = own["layer_types"][:1] * overrides["num_layers"]
        overrides = {k: v for k, v in overrides.items() if k != "num_layers"}
    return {"hidden_size": width, **own, **overrides}


def lineage_configs(width: int, vocab_size: int, **overrides) -> dict:
    """{name: ModelConfig} of the lineage at `width` (`lineage_overrides`)."""
    return {
        name: get_config(preset, vocab_size=vocab_size, **lineage_overrides(name, width, **overrides))
        for name, (preset, _) in LINEAGE.items()
    }


def run(mode: str, docs: Path, **options) -> Result:
    """Train the lineage (module docstring) and report it. Checkpoints go to runs/lab-lineage[-full]/MODEL
    (smoke mode: a generated corpus and its checkpoints in a temporary folder)."""
    if options:
        raise ValueError(f"k3 lab lineage takes no options, got {sorted(options)}")
    if mode not in SIZES:
        raise ValueError(f"k3 lab lineage: `mode` must be one of {tuple(SIZES)}, got {mode!r}")
    kept = Path("runs") / ("lab-lineage-full" if mode == "full" else "lab-lineage")
    folder = tempfile.TemporaryDirectory(prefix="k3-lab-lineage-") if mode == "smoke" else contextlib.nullcontext(kept)
    with folder as root:
        return _run(mode, Path(docs), Path(root))


def _run(mode: str, docs: Path, root: Path) -> Result:
    import torch

    from ..bench.timing import interleaved_best, matmul_gflops
    from ..bench.train import step_cases
    from ..training import TrainConfig, prepare, train
    from .inspect.checkpoint import write_corpus

    s = SIZES[mode]
    corpus = (
        dict(data=str(write_corpus(root)), tokenizer="byte", seq_len=32, batch_size=2, warmup_steps=2, val_fraction=0.2)
        if mode == "smoke"
        else dict(data=None)
    )
    base = TrainConfig(
        **corpus,
        time_budget=s["minutes"],
        max_steps=s["steps"],
        eval_every=10**9,
        eval_tokens=s["eval_tokens"],
        final_eval_tokens=4 * s["eval_tokens"],
        seed=0,
    )
    tokenizer, data = prepare(base)
    configs = lineage_configs(s["width"], tokenizer.vocab_size, **s["overrides"])
    gflops = matmul_gflops()
    torch.manual_seed(0)
    models = {name: CausalLM(c) for name, c in configs.items()}
    step_seconds = interleaved_best(step_cases(models, base, data), s["speed_rounds"], grad=True)
    del models
    tokens_per_step = base.batch_size * base.seq_len
    runs = {}
    for name, c in configs.items():
        # evaluations spread over the run: its step count estimated from the measured step time
        expected = s["steps"] or max(1, int(s["minutes"] * 60 / step_seconds[name]))
        cfg = dataclasses.replace(
            base,
            preset=LINEAGE[name][0],
            eval_every=max(1, expected // s["evaluations"]),
            model_overrides=lineage_overrides(name, s["width"], **s["overrides"]),
            out=str(root / _slug(name)),
            overwrite=True,
        )  # the lab's own folder
        print(f"k3 lab lineage: {name} ({LINEAGE[name][0]}, {count_params(c).total:,} parameters)", flush=True)
        history = train(cfg, progress=False)
        runs[name] = _curve(history, Path(cfg.out) / "metrics.jsonl", tokens_per_step)
    return _report(mode, docs, s, configs, runs, step_seconds, tokens_per_step, gflops, base)


def _budget(s: dict) -> str:
    return f"{s['minutes']:g} min" if s["minutes"] else f"{s['steps']} steps"


def _slug(name: str) -> str:
    return name.lower().replace(" ", "-")


def _curve(history: dict, metrics_path: Path, tokens_per_step: int) -> dict:
    """The run's evaluations as (step, tokens, training seconds, bits/byte) and its final figures. Training
    seconds are the steps' own (metrics.jsonl: tokens over tokens/s), evaluations excluded."""
    from ..training.metrics import read_metrics

    seconds, elapsed = {}, 0.0
    for record in read_metrics(metrics_path):
        if "tokens_per_s" in record:
            elapsed += tokens_per_step / max(record["tokens_per_s"], 1e-9)
            seconds[record["step"]] = elapsed
    steps = history["val_step"]
    return {
        "step": steps,
        "tokens": [s * tokens_per_step for s in steps],
        "seconds": [seconds[s] for s in steps],
        "bpb": history["val_bpb"],
        "final_bpb": history["final_val_bpb"],
        "steps": history["step"][-1],
        "train_seconds": elapsed,
    }


def bpb_at(curve: dict, tokens: float) -> float:
    """The run's validation bits/byte at `tokens` training tokens, linear between its evaluations (its
    first evaluation's value before it, its last one's after it)."""
    xs, ys = curve["tokens"], curve["bpb"]
    if tokens <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if tokens <= x1:
            return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
    return ys[-1]


def _report(mode, docs, s, configs, runs, step_seconds, tokens_per_step, gflops, base) -> Result:
    fewest = min(r["tokens"][-1] for r in runs.values())
    rows, data = [], {}
    for name, c in configs.items():
        pc, r = count_params(c), runs[name]
        state = sum(cache_bytes(c, DECODE_CONTEXT).values())
        at_fewest, tokens_per_s = bpb_at(r, fewest), tokens_per_step / step_seconds[name]
        rows.append(
            [
                name,
                c.num_layers,
                f"{pc.total:,}",
                f"{pc.active:,}",
                binary_bytes(state),
                f"{tokens_per_s:,.0f}",
                r["steps"],
                f"{r['tokens'][-1]:,}",
                round(at_fewest, 3),
                round(r["final_bpb"], 3),
            ]
        )
        data[name] = {
            **r,
            "parameters": pc.total,
            "active": pc.active,
            "decode_state_bytes": state,
            "tokens_per_s": tokens_per_s,
            "bpb_at_fewest_tokens": at_fewest,
        }
    budget = _budget(s)
    corpus = "the demo corpus" if base.data is None else "a generated corpus (smoke mode)"
    table = Table(
        f"Every lineage model at width {s['width']}, {budget} of training each on {corpus} "
        f"({base.batch_size} x {base.seq_len} tokens per step, {base.optimizer}, lr {base.lr:g}); decode "
        f"state of one sequence at {DECODE_CONTEXT:,} tokens in bf16; tokens/s measured side by side "
        f"(machine matmul {gflops:.0f} GFLOP/s)",
        [
            "model",
            "layers",
            "parameters",
            "active",
            f"decode state @ {DECODE_CONTEXT:,}",
            "train tokens/s",
            "steps",
            "tokens seen",
            f"val bits/byte @ {fewest:,} tokens",
            "val bits/byte (final)",
        ],
        rows,
    )
    figures = _plots(docs, runs, s, budget)
    return Result(
        name="lineage",
        title="The lineage on language modelling",
        mode=mode,
        command=command("lineage", mode),
        claims=_claims(data, fewest, budget),
        tables=[table],
        figures=figures,
        notes=[
            paragraph(
                "lineage", "evaluation", final_tokens=4 * s["eval_tokens"], eval_tokens=s["eval_tokens"], fewest=fewest
            ),
            paragraph("lineage", "depth"),
        ],
        setup=dict(
            seed=0,
            width=s["width"],
            budget=budget,
            eval_tokens=s["eval_tokens"],
            models={n: [LINEAGE[n][0], LINEAGE[n][1]] for n in LINEAGE},
            overrides=s["overrides"],
            matmul_gflops=round(gflops),
        ),
        data=data,
    )


def _claims(data: dict, fewest: int, budget: str) -> list[Claim]:
    final = {n: d["final_bpb"] for n, d in data.items()}
    steps = list(zip(CHAIN, CHAIN[1:]))
    improved = [b for a, b in steps if final[b] <= final[a] - BETTER]
    chain = " -> ".join(f"{n} {final[n]:.3f}" for n in CHAIN)
    verdict = (
        "holds" if len(improved) == len(steps) else "partly" if len(improved) >= len(steps) - 1 else "does not hold"
    )
    claims = [
        Claim(
            "Each architecture in this progression adds capacity to address a concrete limitation in the "
            "preceding system",
            f"validation bits/byte after {budget} each: {chain}; {len(improved)} of {len(steps)} steps "
            f"lower by >= {BETTER} (holds if all, partly if all but one)",
            verdict,
        )
    ]
    gpt2 = final["GPT-2"]
    wins = [n for n in HYBRIDS if final[n] <= gpt2 - BETTER]
    ties = [n for n in HYBRIDS if abs(final[n] - gpt2) < BETTER]
    per_token = ", ".join(f"{n} {data[n]['bpb_at_fewest_tokens']:.3f}" for n in ("GPT-2", *HYBRIDS))
    state = ", ".join(f"{n} {binary_bytes(data[n]['decode_state_bytes'])}" for n in ("GPT-2", *HYBRIDS))
    claims.append(
        Claim(
            "Kimi Linear, under controlled comparisons, outperformed full attention (a drop-in replacement with better "
            "quality)",
            f"after {budget} each: GPT-2 {gpt2:.3f}, "
            + ", ".join(f"{n} {final[n]:.3f}" for n in HYBRIDS)
            + f" bits/byte; at {fewest:,} tokens each: {per_token}; decode state at {DECODE_CONTEXT:,} tokens: {state} "
            f"(holds if both hybrids are lower by >= {BETTER}, partly if one is, or both within {BETTER})",
            "holds"
            if len(wins) == len(HYBRIDS)
            else "partly"
            if wins or len(ties) == len(HYBRIDS)
            else "does not hold",
        )
    )
    return claims


def _plots(docs: Path, runs: dict, s: dict, budget: str) -> list[Figure]:
    path = "figures/lineage.png"
    with figure(docs / path, ncols=2, size=(11.0, 4.2)) as (fig, (by_tokens, by_seconds)):
        for name, r in runs.items():
            style = "-" if name in (*HYBRIDS, "GPT-2") else "--"
            by_tokens.plot(r["tokens"], r["bpb"], style, marker=".", label=name)
            by_seconds.plot(r["seconds"], r["bpb"], style, marker=".", label=name)
        by_tokens.set_xlabel("training tokens")
        by_seconds.set_xlabel("training seconds (evaluations excluded)")
        for ax in (by_tokens, by_seconds):
            ax.set_ylabel("validation bits per byte")
            ax.grid(alpha=0.3)
        by_seconds.legend(fontsize=8)
    return [
        Figure(
            path,
            f"Validation bits per byte of every lineage model at width {s['width']} ({budget} each): "
            "against the tokens it trained on (left) and the seconds it trained (right)",
        )
    ]
