"""`k3 bench llama`: k3 beside llama.cpp, the engine people run small models with on a CPU, on the same
weights with the same threads.

Models: kimi-k3-tiny, kimi-linear-tiny and the matched GPT-2 of `k3 bench models` (the same builds, vocab
4,096), and kimi-k3-100m, Kimi K3's structure at 101M parameters (width 768, 12 layers, 8 experts), where
the matrices dominate. Each is written once as GGUF float32 and q8_0 (`k3.checkpoints.gguf_format`, what
`k3 export --format gguf` writes) and loaded by llama-cpp-python (float32 caches, `n_threads` = torch's).

- prefill: tokens/s of one sequence of PREFILL tokens from an empty cache: k3 eager (`model(ids,
  cache=...)`, the chunked prefill `generate` runs), llama.cpp f32 and q8_0 (one `eval` of the tokens);
  the best of `rounds` interleaved rounds;
- decode: tokens/s of one greedy token a step at each context (256 and 4,096 tokens before it): k3 eager
  (the growing cache and fused weights `generate` uses), k3 compiled (`k3.inference.decode_step`, a static
  cache), llama.cpp f32 and q8_0 (`eval` of one token, the next chosen from its logits). As a decode loop
  runs, each engine takes its steps back to back (its weights warm in the caches), the engines in turn,
  `rounds` times in alternating order (`block_steps`); the median of every timed step.

Ratios: k3 / llama.cpp f32 (above 1: k3 is faster). Needs k3[llama] (llama-cpp-python, built for the
machine: `make test-gguf` installs it) and, for the compiled decode, a C++ compiler.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..checkpoints.gguf_format import write_gguf
from ..inference.generation import static_length
from ..models import CausalLM, get_config
from .compiled import Case
from .runners import GPT2, K3_TINY, KIMI_LINEAR, LABELS, VOCAB, build_k3
from .timing import interleaved_best, matmul_gflops, threads, write_report

K3_100M = "kimi-k3-100m"
# Kimi K3's parts at ~100M parameters: 3:1 KDA/MLA, gated MLA with query LoRA, latent MoE, AttnRes
K3_100M_CONFIG = dict(
    hidden_size=768,
    num_layers=12,
    layer_types=["kda", "kda", "kda", "mla"] * 3,
    mlp_types=["dense"] + ["moe"] * 11,
    num_heads=6,
    linear_num_heads=6,
    linear_head_dim=128,
    q_lora_rank=384,
    kv_lora_rank=256,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=128,
    intermediate_size=2048,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=384,
    moe_latent_size=384,
    num_shared_experts=1,
    attn_res_block_size=4,
)
NAMES = (K3_TINY, KIMI_LINEAR, GPT2, K3_100M)
ENGINES = ("k3 eager", "k3 compiled", "llama.cpp f32", "llama.cpp q8_0")


@dataclass(frozen=True)
class Settings:
    contexts: tuple[int, ...] = (256, 4096)
    prefill: int = 512
    steps: int = 24
    warmup: int = 3
    rounds: int = 3


QUICK = Settings(steps=12, rounds=2)


def build(names, positions: int) -> dict[str, CausalLM]:
    """The benchmark's k3 models, seeded, float32, in eval mode."""
    out, _ = build_k3([n for n in names if n != K3_100M], positions)
    if K3_100M in names:
        torch.manual_seed(0)
        out[K3_100M] = CausalLM(get_config(K3_TINY, vocab_size=VOCAB, **K3_100M_CONFIG)).eval()
    return {n: out[n] for n in names}


class LlamaCase:
    """llama.cpp holding `context` tokens of one sequence; each call decodes one greedy token."""

    def __init__(self, path: Path, context: int, n_threads: int, generator: torch.Generator, extra: int = 64):
        self.llm = load(path, context + extra, n_threads)
        ids = torch.randint(0, VOCAB, (context,), generator=generator).tolist()
        self.llm.eval(ids)
        self.token = ids[-1]

    def __call__(self) -> None:
        import llama_cpp

        self.llm.eval([self.token])  # the last token's logits, read where llama.cpp leaves them
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(self.llm.ctx), shape=(self.llm.n_vocab(),))
        self.token = int(np.argmax(logits))


def block_steps(cases: dict, warmup: int, steps: int, rounds: int) -> dict:
    """Median seconds of one step of each case: per round, each case's `warmup` untimed and `steps` timed
    steps back to back, the cases in turn (reversed every other round)."""
    order, times = list(cases), {key: [] for key in cases}
    for r in range(rounds):
        for key in order if r % 2 == 0 else reversed(order):
            for i in range(warmup + steps):
                start = time.perf_counter()
                cases[key]()
                if i >= warmup:
                    times[key].append(time.perf_counter() - start)
    return {key: statistics.median(t) for key, t in times.items()}


def load(path: Path, n_ctx: int, n_threads: int):
    from llama_cpp import Llama

    # type_k = type_v = 0: float32 caches, as k3's; llama.cpp's notes on stderr while it loads silenced
    with _stderr_silenced():
        return Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            n_batch=min(n_ctx, 2048),
            n_threads=n_threads,
            n_threads_batch=n_threads,
            verbose=False,
            type_k=0,
            type_v=0,
        )


@contextlib.contextmanager
def _stderr_silenced():
    """File descriptor 2 to /dev/null for the block: llama.cpp's C code writes there even with verbose=False."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def prefill_cases(model, files: dict, tokens: int, n_threads: int) -> dict:
    ids = torch.randint(0, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(1))
    cases = {"k3 eager": lambda: model(ids, cache=model.new_cache(1))}
    for engine, path in files.items():
        llm = load(path, tokens + 8, n_threads)

        def run(llm=llm):
            llm.reset()
            llm.eval(ids[0].tolist())

        cases[engine] = run
    return cases


def _require_llama() -> None:
    try:
        import llama_cpp  # noqa: F401
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            "k3 bench llama needs llama-cpp-python, built for this machine: `make test-gguf` installs it "
            "(or pip install 'k3[llama]' with CMAKE_ARGS=-DGGML_NATIVE=ON)",
            name="llama_cpp",
        ) from e


def run(quick: bool = False, models=None, contexts=None, steps=None, n_threads=None, json_path=None, out=None) -> dict:
    """Time k3 and llama.cpp (see the module docstring); print the table, return the figures."""
    from ..runtime import check_compiler

    _require_llama()
    check_compiler("cpu", "bench llama")
    base = QUICK if quick else Settings()
    s = Settings(**{**base.__dict__, **{k: v for k, v in dict(contexts=contexts, steps=steps).items() if v}})
    n_threads = n_threads or torch.get_num_threads()
    say = out or print
    names = tuple(models or NAMES)
    unknown = sorted(set(names) - set(NAMES))
    if unknown:
        raise ValueError(f"bench llama: `models` must be among {list(NAMES)}, got {unknown}")
    gflops = matmul_gflops()
    say(f"k3 bench llama: {n_threads} threads; this machine's float32 matmul (1024^3): {gflops:.0f} GFLOP/s")
    results = {"threads": n_threads, "matmul_gflops": gflops, "settings": s.__dict__, "models": {}}
    positions = static_length(max(max(s.contexts) + s.steps + s.warmup + 64, s.prefill + 8))  # GPT-2's
    with threads(n_threads), tempfile.TemporaryDirectory(prefix="k3-bench-llama-") as tmp:
        for name, model in build(names, positions).items():
            results["models"][name] = row = _measure(name, model, Path(tmp), s, n_threads)
            say(_line(name, model, row, s))
    say(_ratios(results))
    if json_path:
        write_report(json_path, results, "k3 bench llama")
    return results


def _measure(name: str, model, tmp: Path, s: Settings, n_threads: int) -> dict:
    files = {}
    for outtype in ("f32", "q8_0"):
        files[f"llama.cpp {outtype}"] = path = tmp / f"{name}-{outtype}.gguf"
        write_gguf(model, path, outtype)
    best = interleaved_best(prefill_cases(model, files, s.prefill, n_threads), s.rounds)
    row = {"prefill": {engine: s.prefill / t for engine, t in best.items()}, "decode": {}}
    for context in s.contexts:
        g = torch.Generator().manual_seed(context)
        tokens = s.rounds * (s.steps + s.warmup)  # each engine's tokens after the context
        cases = {
            "k3 eager": Case(model, context, 1, False, tokens, g),
            "k3 compiled": Case(model, context, 1, True, tokens, g),
            **{engine: LlamaCase(path, context, n_threads, g, tokens + 8) for engine, path in files.items()},
        }
        start = time.perf_counter()
        times = block_steps(cases, s.warmup, s.steps, s.rounds)
        row["decode"][context] = {engine: 1 / t for engine, t in times.items()}
        row.setdefault("seconds", 0.0)
        row["seconds"] += time.perf_counter() - start
    return row


def _line(name: str, model, row: dict, s: Settings) -> str:
    label = LABELS.get(name, name)
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    lines = [f"\n{label} ({millions:.1f}M parameters), tokens/s", f"  {'':22s}" + "".join(f"{e:>16s}" for e in ENGINES)]
    prefill = row["prefill"]
    lines.append(f"  {f'prefill {s.prefill}':22s}" + "".join(_cell(prefill.get(e)) for e in ENGINES))
    for context, speeds in row["decode"].items():
        lines.append(f"  {f'decode at {context:,}':22s}" + "".join(_cell(speeds.get(e)) for e in ENGINES))
    return "\n".join(lines)


def _cell(value) -> str:
    return f"{value:16,.0f}" if value is not None else f"{'-':>16s}"


def _ratios(results: dict) -> str:
    lines = ["\nk3 / llama.cpp f32 (above 1: k3 is faster)"]
    for name, row in results["models"].items():
        parts = [f"prefill {row['prefill']['k3 eager'] / row['prefill']['llama.cpp f32']:.2f}x"]
        for context, speeds in row["decode"].items():
            compiled = speeds["k3 compiled"] / speeds["llama.cpp f32"]
            parts.append(f"decode@{context} compiled {compiled:.2f}x")
        lines.append(f"  {LABELS.get(name, name)}: " + ", ".join(parts))
    return "\n".join(lines)
