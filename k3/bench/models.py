"""`k3 bench models`: whole-model speed side by side, on one machine in one run.

Rows: kimi-k3-tiny, kimi-linear-tiny and the GPT-2 that `k3 bench train` matches to kimi-k3-tiny
(gpt2-tiny at width 192, the depth closest in total parameters, learned positions for the longest
context), all k3's, at vocab 4,096, seed 0, float32; and, when transformers is installed, its
GPT2LMHeadModel of the matched GPT-2's shape (its own random init: speed, not outputs, is compared)
and its KimiLinearForCausalLM loading kimi-linear-tiny's weights (exported in Kimi Linear's own
format; its logits are checked against k3's before anything is timed).

Columns, per model:
- prefill: one forward of T tokens (batch 1) into a fresh cache, in inference mode;
- train step: AdamW on B x T tokens, forward + backward + clipped step (k3: `training_step` with a
  `TrainConfig(optimizer="adamw")`; transformers: its loss from labels, backward, the same clip, AdamW);
- decode: ms per token at batch 1 after a context of N tokens (prefilled once, untimed), the median of
  single-token steps taken round-robin across every model (so all see the same machine phases; each
  context grows by the steps taken);
- batch: decode tokens/s at batch 8 (equal-length prompts, the first context) over batch 1, k3's models.

Prefill and train step are timed in interleaved rounds (`interleaved_best`: every case once per round
after one warm-up call, the best round kept). Ratios are time against the matched GPT-2 (k3's), so < 1 is faster; the
issue's targets are printed beside them, each with a plain yes or no, at the contexts measured.

Defaults: prefill 2,048, train step 16 x 256, decode at 256 and 4,096, best of 3 rounds, median of 24
steps: about three minutes on 2 quiet cores. `QUICK` (2 rounds, 16 steps, train step 8 x 256, the same
contexts): about a minute. Every setting can be shrunk (the tests run in seconds). On a shared machine
`--threads 1` is steadier: with two threads, a core taken by another process stalls every op.
"""

from __future__ import annotations

import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ..training import TrainConfig
from .runners import (
    GPT2,
    HF_GPT2,
    HF_KIMI,
    K3_TINY,
    KIMI_LINEAR,
    LABELS,
    MODELS,
    VOCAB,
    Runner,
    _transformers,
    build_hf_gpt2,
    build_hf_kimi,
    build_k3,
    logits_error,
)
from .timing import interleaved_best, matmul_gflops, threads, write_report

LOGITS_TOLERANCE = 1e-5  # relative error of transformers' Kimi Linear logits against k3's (fp32)


@dataclass(frozen=True)
class Settings:
    contexts: tuple[int, ...] = (256, 4096)  # decode contexts; the batch column uses the first
    prefill: int = 2048  # prefill tokens
    train: tuple[int, int] = (16, 256)  # training batch x sequence length
    batch: tuple[int, int] = (1, 8)  # batch sizes compared in the batch column
    rounds: int = 3  # interleaved rounds of prefill and train step (the best is kept)
    steps: int = 24  # timed decode steps per model and context (the median is kept)
    warmup: int = 2  # untimed decode steps first


QUICK = Settings(contexts=(256, 4096), prefill=2048, train=(8, 256), rounds=2, steps=16, warmup=1)


def _threads() -> str:
    n = torch.get_num_threads()
    return f"{n} thread" + ("s" if n != 1 else "")


# -- timing ------------------------------------------------------------------------------------------
def median_steps(entries: dict, warmup: int, steps: int) -> dict:
    """Median seconds of one decode step for each entry, key -> (runner, token, cache). Steps go
    round-robin across the entries, in reverse order every other round (no entry always follows the
    same one)."""
    order, times = list(entries), {key: [] for key in entries}
    for step in range(warmup + steps):
        for key in order if step % 2 == 0 else reversed(order):
            runner, token, cache = entries[key]
            start = time.perf_counter()
            runner.decode(token, cache)
            if step >= warmup:
                times[key].append(time.perf_counter() - start)
    return {key: statistics.median(t) for key, t in times.items()}


def measure(runners: dict[str, Runner], s: Settings, seed: int = 0) -> dict[str, dict]:
    gen = torch.Generator().manual_seed(seed)
    ids = lambda *shape: torch.randint(0, VOCAB, shape, generator=gen)  # noqa: E731
    res = {name: {"label": LABELS[name], "parameters": r.parameters, "decode_s": {}} for name, r in runners.items()}
    prompt = ids(1, s.prefill)
    times = interleaved_best({n: (lambda r=r: r.prefill(prompt)) for n, r in runners.items()}, s.rounds)
    for name, t in times.items():
        res[name]["prefill_s"] = t
    small, big = s.batch
    for i, context in enumerate(s.contexts):
        entries = {}
        for name, r in runners.items():
            sizes = (small, big) if i == 0 and not r.hf else (small,)
            for b in sizes:
                entries[(name, b)] = (r, ids(b, 1), r.prefill(ids(b, context)))
        times = median_steps(entries, s.warmup, s.steps)
        for (name, b), t in times.items():
            if b == small:
                res[name]["decode_s"][context] = t
            else:
                res[name]["batch_decode_s"] = {small: times[(name, small)], big: t}
                res[name]["batch_speedup"] = (big / t) / (small / times[(name, small)])
        del entries
    # AdamW for every model: transformers' models train with torch's AdamW here, so the step is like for like
    cfg = TrainConfig(batch_size=s.train[0], seq_len=s.train[1], optimizer="adamw")
    windows = ids(s.train[0], s.train[1] + 1)
    cases = {name: r.train_case(windows, cfg) for name, r in runners.items()}
    for name, t in interleaved_best(cases, s.rounds, grad=True).items():
        res[name]["train_step_s"] = t
        res[name]["train_tokens_per_s"] = s.train[0] * s.train[1] / t
    for r in runners.values():
        r.model.eval()
    return res


# -- the report ---------------------------------------------------------------------------------------
def ratios(res: dict, s: Settings) -> dict[str, dict]:
    """Time of every model over the matched GPT-2's, per column (empty without the GPT-2 row)."""
    if GPT2 not in res:
        return {}
    base = res[GPT2]
    out = {}
    for name, r in res.items():
        out[name] = {
            "prefill": r["prefill_s"] / base["prefill_s"],
            "train_step": r["train_step_s"] / base["train_step_s"],
            "decode": {c: r["decode_s"][c] / base["decode_s"][c] for c in s.contexts},
        }
    return out


def targets(res: dict, rat: dict, s: Settings) -> list[dict]:
    """The issue's targets that the rows measured can answer: (what, measured, holds)."""
    out = []
    lo, hi = s.contexts[0], s.contexts[-1]
    if K3_TINY in rat:
        out.append(
            dict(
                target=f"kimi-k3-tiny decode at {lo} context <= 1.0x GPT-2's time",
                measured=rat[K3_TINY]["decode"][lo],
                holds=rat[K3_TINY]["decode"][lo] <= 1.0,
            )
        )
        if hi != lo:
            out.append(
                dict(
                    target=f"kimi-k3-tiny decode at {hi} context <= 0.5x GPT-2's time",
                    measured=rat[K3_TINY]["decode"][hi],
                    holds=rat[K3_TINY]["decode"][hi] <= 0.5,
                )
            )
    if KIMI_LINEAR in res and HF_KIMI in res:
        for c in s.contexts:
            x = res[HF_KIMI]["decode_s"][c] / res[KIMI_LINEAR]["decode_s"][c]
            out.append(
                dict(
                    target=f"kimi-linear-tiny decode at {c} context >= 4x faster than transformers' "
                    f"KimiLinearForCausalLM",
                    measured=x,
                    holds=x >= 4.0,
                )
            )
    for name in (K3_TINY, KIMI_LINEAR, GPT2):
        if name in res and "batch_speedup" in res[name]:
            x = res[name]["batch_speedup"]
            out.append(
                dict(
                    target=f"{name} decode at batch {s.batch[1]} >= 4x batch {s.batch[0]}'s tokens/s "
                    f"({s.contexts[0]} context)",
                    measured=x,
                    holds=x >= 4.0,
                )
            )
    return out


def table(res: dict, rat: dict, s: Settings) -> list[str]:
    """The Markdown table: one row per model, times with their ratio to the matched GPT-2."""

    def ratio(name, *key):
        if name not in rat:
            return ""
        value = rat[name]
        for k in key:
            value = value[k]
        return f" ({value:.2f}x)"

    B, T = s.train
    head = (
        ["model", "parameters", f"prefill {s.prefill}", f"train step {B}x{T}"]
        + [f"decode @{c} (ms/token)" for c in s.contexts]
        + [f"decode batch {s.batch[1]} (tok/s: x batch {s.batch[0]})"]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in res.items():
        cells = [
            r["label"],
            f"{r['parameters'] / 1e6:.2f}M",
            f"{r['prefill_s'] * 1e3:.0f} ms{ratio(name, 'prefill')}",
            f"{r['train_step_s'] * 1e3:.0f} ms, {r['train_tokens_per_s']:,.0f} tok/s{ratio(name, 'train_step')}",
        ]
        cells += [f"{r['decode_s'][c] * 1e3:.2f}{ratio(name, 'decode', c)}" for c in s.contexts]
        if "batch_speedup" in r:
            big = s.batch[1] / r["batch_decode_s"][s.batch[1]]
            cells.append(f"{big:,.0f} tok/s: {r['batch_speedup']:.1f}x")
        else:
            cells.append("")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def peers(res: dict, s: Settings) -> list[str]:
    """k3's speed-up over transformers' implementation of the same model, per column."""
    lines = []
    for ours, theirs in ((KIMI_LINEAR, HF_KIMI), (GPT2, HF_GPT2)):
        if ours in res and theirs in res:
            a, b = res[ours], res[theirs]
            parts = [
                f"prefill {b['prefill_s'] / a['prefill_s']:.1f}x",
                f"train step {b['train_step_s'] / a['train_step_s']:.1f}x",
            ]
            parts += [f"decode @{c} {b['decode_s'][c] / a['decode_s'][c]:.1f}x" for c in s.contexts]
            lines.append(f"k3's {ours} against {LABELS[theirs]}: " + ", ".join(parts) + " faster")
    return lines


def run(
    quick: bool = False,
    contexts=None,
    prefill: int | None = None,
    train=None,
    batch=None,
    rounds: int | None = None,
    steps: int | None = None,
    warmup: int | None = None,
    models=MODELS,
    n_threads: int | None = None,
    json_path: str | None = None,
    seed: int = 0,
    out=None,
) -> dict:
    """Time `models` (names from MODELS) under QUICK or the default Settings, any field given here
    overriding; print the table and targets to `out` (stdout) and return (and write) every figure."""
    base = QUICK if quick else Settings()
    given = dict(
        contexts=contexts, prefill=prefill, train=train, batch=batch, rounds=rounds, steps=steps, warmup=warmup
    )
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in given.items() if v is not None}
    s = Settings(**{**base.__dict__, **given})
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise ValueError(f"bench models: unknown models {unknown}; choose from {', '.join(MODELS)}")
    out = sys.stdout if out is None else out

    def say(line=""):
        print(line, file=out, flush=True)

    with threads(n_threads) if n_threads else nullcontext():
        return _run(s, list(models), seed, json_path, say)


def _run(s: Settings, names: list[str], seed: int, json_path: str | None, say) -> dict:
    positions = max(s.prefill, s.train[1], max(s.contexts) + s.warmup + s.steps)
    k3_names = [n for n in names if n in (K3_TINY, KIMI_LINEAR, GPT2)]
    need_k3 = set(k3_names) | ({KIMI_LINEAR} if HF_KIMI in names else set())  # whose weights it loads
    k3_models, gpt = build_k3([n for n in (K3_TINY, KIMI_LINEAR, GPT2) if n in need_k3], positions, seed)
    runners = {n: Runner(n, k3_models[n], hf=False) for n in k3_names}
    gemm = matmul_gflops()
    say(
        f"k3 bench models: vocab {VOCAB}, float32, seed {seed}, {_threads()}; machine matmul "
        f"{gemm:.1f} GFLOP/s (1024^3 float32 GEMM)"
    )
    say(
        f"matched GPT-2: gpt2-tiny at width {gpt['hidden_size']}, {gpt['num_layers']} layers, positions for "
        f"{positions} tokens"
    )
    notes, check = [], None
    wanted_hf = [n for n in names if n in (HF_GPT2, HF_KIMI)]
    transformers = _transformers() if wanted_hf else None
    if wanted_hf and transformers is None:
        notes.append("transformers is not installed: no transformers rows (pip install 'k3[hf]')")
    elif transformers is not None:
        if HF_GPT2 in names:
            runners[HF_GPT2] = Runner(HF_GPT2, build_hf_gpt2(transformers, gpt, seed), hf=True)
        if HF_KIMI in names and not hasattr(transformers, "KimiLinearForCausalLM"):
            notes.append(f"transformers {transformers.__version__} has no KimiLinearForCausalLM: no row for it")
        elif HF_KIMI in names:
            k3_kimi = Runner(KIMI_LINEAR, k3_models[KIMI_LINEAR], hf=False)
            hf_kimi = Runner(HF_KIMI, build_hf_kimi(transformers, k3_models[KIMI_LINEAR]), hf=True)
            error = logits_error(k3_kimi, hf_kimi)
            check = {"relative_error": error, "tolerance": LOGITS_TOLERANCE, "passes": error <= LOGITS_TOLERANCE}
            if not check["passes"]:
                raise RuntimeError(
                    f"bench models: transformers' KimiLinearForCausalLM gives logits {error:.1e} away "
                    f"from k3's kimi-linear-tiny (tolerance {LOGITS_TOLERANCE:.0e}): not the same model"
                )
            say(
                f"transformers' KimiLinearForCausalLM loads kimi-linear-tiny's weights: logits (prefill and one decode "
                f"step) within {error:.1e} of k3's"
            )
            runners[HF_KIMI] = hf_kimi
    for note in notes:
        say(note)
    runners = {n: runners[n] for n in names if n in runners}  # the order asked for
    B, T = s.train
    say(
        f"prefill {s.prefill} tokens and train step {B}x{T}: best of {s.rounds} interleaved rounds; decode at "
        f"{', '.join(map(str, s.contexts))} tokens of context: median of {s.steps} steps round-robin; "
        f"ratios: time over gpt2-tiny's\n"
    )
    start = time.perf_counter()
    res = measure(runners, s, seed)
    rat = ratios(res, s)
    for line in table(res, rat, s):
        say(line)
    say()
    for line in peers(res, s):
        say(line)
    tgt = targets(res, rat, s)
    if tgt:
        say("\ntargets (issue 13):")
    for t in tgt:
        say(f"  {t['target']}: {t['measured']:.2f}x -> {'yes' if t['holds'] else 'no'}")
    say(f"\n({time.perf_counter() - start:.0f} s of timing)")
    report = {
        "threads": torch.get_num_threads(),
        "gemm_gflops": gemm,
        "settings": s.__dict__,
        "matched_gpt2": gpt,
        "transformers": transformers.__version__ if transformers else None,
        "notes": notes,
        "kimi_linear_logits_check": check,
        "models": res,
        "ratios_vs_gpt2": rat,
        "targets": tgt,
    }
    if json_path:
        write_report(json_path, report, "models")
    return report
