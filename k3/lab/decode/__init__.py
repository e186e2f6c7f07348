"""`k3 lab decode`: per-token decode latency and cache bytes against context length.

The article: a KV cache "retains vectors for the previous N-1 tokens" and grows O(N), and each decode
step reads all of it; linear attention and its descendants fold history into a fixed state, so KDA's
decode state is constant; MLA caches a compressed latent (c and k_pe) instead of per-head keys and
values; and "Kimi Linear [...] up to 6x higher decode throughput" (the Kimi Linear report: at 1M tokens
of context).

Measured here, batch size 1, float32, at equal width (hidden_size 128) and each preset's own depth:
gpt2-tiny (4 MHA layers), kimi-linear-tiny (6 KDA + 2 MLA), kimi-k3-tiny (3 KDA + 2 MLA) and, as the
reference for "constant", kimi-linear-tiny with every layer KDA. For each context length N a cache
holding N tokens is built, for every model and N at once; then every (model, N) pair takes one decode
step per round, round after round, and keeps the median of its steps.

Building the caches. Prefilling 64K tokens through four models would take most of the budget, so the
caches are filled directly: a real prefill of a few tokens gives every layer its cache (the KDA layers'
conv and recurrent states, which do not depend on N), then each MHA layer's keys and values and each
MLA layer's latents are replaced by random tensors of N tokens with the shapes and dtype a prefill
leaves, and the cache's length is set to N. A decode step's cost depends on those shapes, not on the
values; `check_fill` compares, at a small N, the decode time from a filled cache with that from a real
prefill of N tokens (same bytes, same time within noise).

The package: `measure` (the models, the caches, the timed steps), `report` (claims, tables, notes, the
figure); here `run` and `fit_line`, the line through latency against N.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..report import Result, command
from . import report
from .measure import BASELINE, PROMPT, SWEEPS, build_models, check_fill, expected_bytes, fill_cache, time_steps


def run(mode: str, docs: Path, **options) -> Result:
    if options:
        raise ValueError(f"k3 lab decode takes no options, got {sorted(options)}")
    sweep = SWEEPS[mode]
    longest = max(sweep.lengths)
    models = build_models(max_length=longest + sweep.warmup + sweep.steps + PROMPT)
    check = check_fill(models, sweep.check_length, sweep)

    # every (model, N) pair in one round-robin: the growth with N is measured side by side too
    gen = torch.Generator().manual_seed(1)
    entries = {(name, N): (model, fill_cache(model, N, gen)) for N in sweep.lengths for name, model in models.items()}
    nbytes = {name: {N: entries[(name, N)][1].nbytes_by_type(held=True) for N in sweep.lengths} for name in models}
    exact = all(nbytes[name][N] == expected_bytes(models[name], N) for name in models for N in sweep.lengths)
    times = time_steps(entries, sweep.warmup, sweep.steps)
    latency = {name: {N: times[(name, N)] for N in sweep.lengths} for name in models}
    del entries

    fit_from = [N for N in sweep.lengths if N >= 4096]
    fit_from = fit_from if len(fit_from) >= 2 else list(sweep.lengths)
    fits = {name: fit_line(fit_from, [latency[name][N] for N in fit_from]) for name in models}
    analysis = {
        "latency": latency,
        "nbytes": nbytes,
        "exact": exact,
        "fits": fits,
        "fit_from": fit_from,
        "check": check,
        "longest": longest,
    }

    setup = {
        "models": {
            name: f"{' '.join(model.config.layer_types)}; hidden {model.config.hidden_size}; "
            f"{model.num_parameters():,} parameters"
            for name, model in models.items()
        },
        "lengths": list(sweep.lengths),
        "decode": f"batch 1, float32, inference mode, {sweep.warmup} warm-up "
        f"and {sweep.steps} timed steps per model and length, round-robin, median",
        "gpt2 positions": models[BASELINE].config.max_position_embeddings,
        "seed": 0,
        "threads": torch.get_num_threads(),
    }
    return Result(
        name="decode",
        title="Decode: latency and cache bytes against context length",
        mode=mode,
        command=command("decode", mode),
        claims=report.claims(sweep, models, analysis),
        tables=report.tables(sweep, models, analysis),
        figures=[report.figure(docs, sweep, models, analysis)],
        notes=report.notes(sweep, models, analysis),
        setup=setup,
    )


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(a, b) of y ≈ a + b·x with a, b >= 0 (a fixed cost and a cost per unit of x), least squares on the
    relative error. When the free fit has a < 0 the line goes through the origin; when b < 0, it is flat."""
    if len(xs) < 2 or len(xs) != len(ys):
        raise ValueError(f"fit_line: needs two or more (x, y) pairs, got {len(xs)} x and {len(ys)} y")
    w = [1.0 / (y * y) for y in ys]
    sw, sx, sy = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * y for wi, y in zip(w, ys))
    sxx, sxy = sum(wi * x * x for wi, x in zip(w, xs)), sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    det = sw * sxx - sx * sx
    b = (sw * sxy - sx * sy) / det if det > 0 else 0.0
    if b <= 0:
        return sy / sw, 0.0
    a = (sy - b * sx) / sw
    if a < 0:
        return 0.0, sxy / sxx
    return a, b
