"""`k3 bench models --compile`: eager and compiled decode side by side, and what compiling costs.

Rows: kimi-k3-tiny, kimi-linear-tiny and the matched GPT-2 of `k3 bench models` (the same builds, vocab
4,096, float32). Per model, context (256 and 4,096 tokens) and batch (1 and 8):
- eager: ms per token of `model(token, cache=cache, fused=...)` over the growing cache, the fused weights
  (`decoding_weights()`) made once: what `generate` does without compiling;
- compiled: ms per token of the compiled decode step (`k3.inference.decode_step.DecodeStep`, inductor with
  its C++ wrapper) over a static cache of `static_length(context + steps)` slots, the size
  `generate(..., compile=True)` picks; greedy, sampling inside the step included.
Every step is one token for every row; the median of single steps taken round-robin over every case
(all see the same machine phases). Ratios: compiled over eager tokens/s; compiled kimi-k3-tiny's time over
the compiled GPT-2's.

Compile times, in fresh processes on a fresh inductor cache (batch 1, the first context): "first" is the
first step of a model that was never compiled (dynamo traces, inductor builds its C++ kernels); "cached"
the same in a second process, which finds them on disk; beside each, the whole run from start to first
token. The compiled steps timed here use the default cache (`k3.inference.decode_step.compile_cache_dir`),
so a second bench run starts quickly.

QUICK: batch 1 only, 16 steps. The default (both batches, 24 steps) compiles 12 graphs, a few minutes on 2
cores the first time.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from ..inference.generation import static_length
from .runners import GPT2, K3_TINY, KIMI_LINEAR, LABELS, VOCAB, build_k3
from .timing import matmul_gflops, write_report

NAMES = (K3_TINY, KIMI_LINEAR, GPT2)


@dataclass(frozen=True)
class Settings:
    contexts: tuple[int, ...] = (256, 4096)
    batch: tuple[int, ...] = (1, 8)
    steps: int = 24  # timed steps per case (the median is kept)
    warmup: int = 3  # untimed steps first (the compiled step's first call compiles)
    compile_times: bool = True  # the fresh-process compile timings


QUICK = Settings(batch=(1,), steps=16)


class Case:
    """One model at one context and batch, decoding eagerly (growing cache) or compiled (static cache)."""

    def __init__(self, model, context: int, batch: int, compiled: bool, steps: int, generator: torch.Generator):
        self.model, self.compiled = model, compiled
        ids = torch.randint(0, VOCAB, (batch, context), generator=generator)
        self.token = ids[:, -1]
        with torch.no_grad():
            if compiled:
                self.cache = model.new_cache(batch, max_length=static_length(context + steps))
                model(ids, cache=self.cache)
                self.step = model.decode_step(self.cache, compile=True)
            else:  # as `generate` decodes eagerly: the joined projections and stacked experts made once
                self.cache = model.new_cache(batch)
                model(ids, cache=self.cache)
                self.fused = model.decoding_weights()

    def __call__(self) -> None:
        if self.compiled:
            self.token = self.step(self.token)
        else:
            with torch.no_grad():
                self.token = self.model(self.token.view(-1, 1), cache=self.cache, fused=self.fused)[:, -1].argmax(-1)


def median_steps(cases: dict, warmup: int, steps: int) -> dict:
    """Median seconds of one step of each case, round-robin, in reverse order every other round."""
    order, times = list(cases), {key: [] for key in cases}
    for i in range(warmup + steps):
        for key in order if i % 2 == 0 else reversed(order):
            start = time.perf_counter()
            cases[key]()
            if i >= warmup:
                times[key].append(time.perf_counter() - start)
    return {key: statistics.median(t) for key, t in times.items()}


def compile_seconds(name: str, context: int, positions: int, cache_dir: str) -> dict:
    """A fresh process that builds `name`, prefills `context` tokens and takes one compiled step (batch 1)
    with inductor's cache in `cache_dir`: {"step": seconds of that first step, "run": seconds from the
    process's start to its first token}."""
    code = (
        f"import time; start = time.perf_counter()\n"
        f"from k3.bench.compiled import _probe; _probe({name!r}, {context}, {positions}, start)"
    )
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"bench models --compile: the compile probe for {name} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _probe(name: str, context: int, positions: int, start: float) -> None:
    models, _ = build_k3([name], positions)
    model = models[name]
    case = Case(model, context, 1, True, 8, torch.Generator().manual_seed(0))
    begin = time.perf_counter()
    case()
    end = time.perf_counter()
    print(json.dumps({"step": end - begin, "run": end - start}))


def run(
    quick: bool = False,
    contexts=None,
    batch=None,
    steps: int | None = None,
    n_threads: int | None = None,
    json_path: str | None = None,
    out=None,
    compile_times: bool | None = None,
) -> dict:
    """Time eager and compiled decode (see the module docstring); print the table and targets, return the figures."""
    from ..runtime import check_compiler

    check_compiler("cpu", "bench models --compile")
    base = QUICK if quick else Settings()
    given = dict(contexts=contexts, batch=batch, steps=steps, compile_times=compile_times)
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in given.items() if v is not None}
    s = Settings(**{**base.__dict__, **given})
    out = sys.stdout if out is None else out

    def say(line=""):
        print(line, file=out, flush=True)

    before = torch.get_num_threads()
    if n_threads:
        torch.set_num_threads(n_threads)
    try:
        return _run(s, say, json_path)
    finally:
        torch.set_num_threads(before)


def _run(s: Settings, say, json_path: str | None) -> dict:
    positions = static_length(max(s.contexts) + s.warmup + s.steps)
    models, gpt = build_k3(list(NAMES), positions)
    gemm = matmul_gflops()
    threads = torch.get_num_threads()
    say(
        f"k3 bench models --compile: vocab {VOCAB}, float32, {threads} thread{'s' * (threads != 1)}; machine "
        f"matmul {gemm:.1f} GFLOP/s (1024^3 float32 GEMM)"
    )
    say(
        f"matched GPT-2: gpt2-tiny at width {gpt['hidden_size']}, {gpt['num_layers']} layers; decode: median of "
        f"{s.steps} steps round-robin, greedy; compiled: inductor (C++ wrapper) over a static cache\n"
    )
    compile_res = {}
    if s.compile_times:
        with tempfile.TemporaryDirectory(prefix="k3-inductor-") as fresh:
            for name in NAMES:
                first = compile_seconds(name, s.contexts[0], positions, fresh)
                cached = compile_seconds(name, s.contexts[0], positions, fresh)
                compile_res[name] = {"first": first, "cached": cached}
                say(
                    f"compile {LABELS[name]}: first {first['step']:.1f} s (run to first token {first['run']:.1f} s), "
                    f"cached {cached['step']:.1f} s (run {cached['run']:.1f} s)"
                )
        say()
    generator = torch.Generator().manual_seed(0)
    cases = {}
    for name in NAMES:
        for context in s.contexts:
            for b in s.batch:
                for compiled in (False, True):
                    cases[(name, context, b, compiled)] = Case(
                        models[name], context, b, compiled, s.warmup + s.steps, generator
                    )
    times = median_steps(cases, s.warmup, s.steps)
    res = {name: {"label": LABELS[name], "decode_s": {}} for name in NAMES}
    for (name, context, b, compiled), t in times.items():
        res[name]["decode_s"][f"{'compiled' if compiled else 'eager'} @{context} x{b}"] = t
    head = ["model", "batch"] + [f"@{c}: eager / compiled ms/token (speed-up)" for c in s.contexts]
    say("| " + " | ".join(head) + " |")
    say("|" + "---|" * len(head))
    for name in NAMES:
        for b in s.batch:
            cells = [LABELS[name], str(b)]
            for c in s.contexts:
                e, k = times[(name, c, b, False)], times[(name, c, b, True)]
                cells.append(f"{e * 1e3:.2f} / {k * 1e3:.2f} ({e / k:.2f}x)")
            say("| " + " | ".join(cells) + " |")
    tgt = targets(times, s, compile_res)
    say("\ntargets (issue 30):")
    for t in tgt:
        say(f"  {t['target']}: {t['measured']:.2f}{t['unit']} -> {'yes' if t['holds'] else 'no'}")
    report = {
        "threads": threads,
        "gemm_gflops": gemm,
        "settings": s.__dict__,
        "matched_gpt2": gpt,
        "models": res,
        "compile": compile_res,
        "targets": tgt,
    }
    if json_path:
        write_report(json_path, report, "compiled")
    return report


def targets(times: dict, s: Settings, compile_res: dict) -> list[dict]:
    lo, hi, b = s.contexts[0], s.contexts[-1], s.batch[0]
    x = times[(K3_TINY, lo, b, False)] / times[(K3_TINY, lo, b, True)]
    out = [
        dict(
            target=f"kimi-k3-tiny compiled decode >= 3x its eager tokens/s at {lo} context, batch {b}",
            measured=x,
            unit="x",
            holds=x >= 3.0,
        )
    ]
    for context, bound in ((lo, 1.0), (hi, 0.5)):
        r = times[(K3_TINY, context, b, True)] / times[(GPT2, context, b, True)]
        out.append(
            dict(
                target=f"compiled kimi-k3-tiny <= {bound}x the compiled GPT-2's time at {context} context",
                measured=r,
                unit="x",
                holds=r <= bound,
            )
        )
    if K3_TINY in compile_res:
        first, cached = compile_res[K3_TINY]["first"]["step"], compile_res[K3_TINY]["cached"]["run"]
        out.append(dict(target="kimi-k3-tiny first compile <= 90 s", measured=first, unit=" s", holds=first <= 90))
        out.append(
            dict(
                target="kimi-k3-tiny cached start (process start to first token) <= 15 s",
                measured=cached,
                unit=" s",
                holds=cached <= 15,
            )
        )
    return out
