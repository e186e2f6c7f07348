"""`k3 bench gpu`: the device check: what k3 does on one CUDA GPU, in one command of under 8 minutes.

Parts, each a row of the report (JSON with `--json`, a Markdown table printed for docs/benchmarks.md):

1. tests: tests/ops/test_cuda.py (k3's ops on the device, and fla's kernels behind them against k3's own
   forms), run by pytest in a subprocess (from a clone: the tests are not installed with the package).
2. ops: chunk KDA and Gated DeltaNet at B=8, T=4,096, H=16, K=V=128 in bfloat16, forward and
   forward+backward: k3's op (its dispatch: fla's kernels on CUDA) against fla called directly (the same
   kernels: the dispatch's overhead, target <= 1.05x) and against k3's own PyTorch form (`use_kernels
   ("torch")`: what fla's kernels win).
3. train: one training step of a Kimi K3-shaped model of about a billion parameters (`MODEL`: the 3:1
   KDA/MLA cycle, latent MoE with SiTU experts, a dense first layer, Block AttnRes) in bf16 autocast with
   `torch.compile` (fullgraph), Muon: tokens/s and MFU, the model FLOPs (`k3.plan.costs`) over the GPU's
   dense bf16 peak (`k3.plan.hardware`, where the GPU is one it lists).
4. decode: the compiled decode step (CUDA graphs) at 4,096 and 32,768 tokens of context, batch 1, ms a
   token: the K3-shaped model, and a Kimi Linear-shaped one beside transformers' KimiLinearForCausalLM
   on the same weights (with fla installed, its KDA runs fla's kernels), where transformers is installed.

`--dry-run` prints what would run and time (shapes, parameters, FLOPs) without a GPU. `TINY` runs every
part at toy sizes on any device (the CPU test of this module), without compile and without the parts
that need CUDA.
"""

from __future__ import annotations

import copy
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..models import CausalLM, get_config
from ..models.params import count_params
from .ops import kda_inputs

MODEL = dict(  # a Kimi K3 of about a billion parameters (counted by --dry-run)
    num_layers=8,
    hidden_size=2048,
    num_heads=16,
    linear_num_heads=16,
    linear_head_dim=128,
    q_lora_rank=768,
    kv_lora_rank=512,
    intermediate_size=5632,
    num_experts=64,
    num_experts_per_tok=6,
    moe_intermediate_size=512,
    moe_latent_size=1024,
    vocab_size=32768,
)
KIMI_LINEAR = dict(  # Kimi Linear's architecture at MODEL's sizes (transformers' model takes it)
    num_layers=8,
    hidden_size=2048,
    num_heads=16,
    linear_num_heads=16,
    linear_head_dim=128,
    kv_lora_rank=512,
    intermediate_size=5632,
    num_experts=64,
    num_experts_per_tok=6,
    moe_intermediate_size=512,
    vocab_size=32768,
)


@dataclass(frozen=True)
class Settings:
    ops: tuple[int, int, int, int] = (8, 4096, 16, 128)  # B, T, H, K = V
    chunk_size: int = 64
    model: dict = field(default_factory=lambda: dict(MODEL))
    kimi_linear: dict = field(default_factory=lambda: dict(KIMI_LINEAR))
    train: tuple[int, int] = (8, 2048)  # sequences x tokens a step
    contexts: tuple[int, ...] = (4096, 32768)
    repeats: int = 10  # timed calls of each op case (the median is kept)
    train_steps: int = 5  # timed training steps after the compiling ones
    decode_steps: int = 50
    compile: bool = True
    dtype: torch.dtype = torch.bfloat16


TINY = Settings(
    ops=(1, 64, 2, 16),
    chunk_size=32,
    model=dict(MODEL, num_layers=4, hidden_size=64, num_heads=2, linear_num_heads=2, linear_head_dim=16,
               q_lora_rank=16, kv_lora_rank=16, intermediate_size=128, num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=32, moe_latent_size=32, vocab_size=256, qk_nope_head_dim=16,
               qk_rope_head_dim=8, v_head_dim=16),
    kimi_linear=dict(KIMI_LINEAR, num_layers=4, hidden_size=64, num_heads=2, linear_num_heads=2,
                     linear_head_dim=16, kv_lora_rank=16, intermediate_size=128, num_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=32, vocab_size=256, qk_nope_head_dim=16,
                     qk_rope_head_dim=8, v_head_dim=16),
    train=(2, 32),
    contexts=(16, 32),
    repeats=2,
    train_steps=1,
    decode_steps=3,
    compile=False,
    dtype=torch.float32,
)  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, device: torch.device, repeats: int, warmup: int = 2) -> float:
    """The median wall time of `fn()` over `repeats` calls after `warmup`, the device synchronised around each."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# -- 1. the CUDA tests ---------------------------------------------------------------------------------


def run_tests(root: Path | None = None) -> dict:
    """pytest over tests/ops/test_cuda.py in a subprocess: {"command", "returncode", "summary"}."""
    root = root or Path(__file__).resolve().parents[2]
    target = root / "tests" / "ops" / "test_cuda.py"
    if not target.exists():
        return {"skipped": f"{target} not found (run k3 bench gpu from a clone of k3)"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(target)]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return {"command": " ".join(command[1:]), "returncode": done.returncode, "summary": lines[-1] if lines else ""}


# -- 2. the ops ----------------------------------------------------------------------------------------


def op_inputs(op: str, s: Settings, device: torch.device, seed: int = 0) -> dict:
    """Inputs of chunk KDA ("kda") or Gated DeltaNet ("gdn") at s.ops, as `k3 bench ops` draws them
    (`kda_inputs`: Kimi K3's safe gate; Gated DeltaNet its first channel), q, k, v, beta in s.dtype."""
    B, T, H, D = s.ops
    q, k, v, g, beta = kda_inputs(T, H, D, seed, B=B, device=device)
    x = {"q": q, "k": k, "v": v, "beta": beta}
    x = {n: t.to(s.dtype) for n, t in x.items()}
    x["g"] = g if op == "kda" else g[..., 0].contiguous()
    return x


def op_cases(op: str, x: dict, s: Settings, device: torch.device) -> dict:
    """name -> callable(grad: bool) running the op once (and its backward when grad)."""
    from .. import ops
    from ..ops import use_kernels

    k3_op = ops.chunk_kda if op == "kda" else ops.chunk_gated_delta_rule
    options = dict(use_qk_l2norm=True, chunk_size=s.chunk_size, check_values=False)
    if op == "kda":
        options["lower_bound"] = -5.0

    def k3_call(choice):
        def call(grad):
            leaves = _leaves(x, grad)
            with use_kernels(choice):  # g in float32 beside bfloat16 q, k, v, as the layers pass it
                o, _ = k3_op(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], **options)
            if grad:
                o.float().sum().backward()

        return call

    # the dispatch as the caller has it set (automatic: fla's kernels on CUDA)
    cases = {"k3 (dispatch)": k3_call(ops.get_kernels()), "k3 PyTorch form": k3_call("torch")}
    if device.type == "cuda" or fla_interpreted():
        if op == "kda":
            from fla.ops.kda import chunk_kda as fla_op

            fla_options = dict(use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=-5.0, chunk_size=s.chunk_size)
        else:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_op

            fla_options = dict(use_qk_l2norm_in_kernel=True, chunk_size=s.chunk_size)

        def fla_call(grad):
            leaves = _leaves(x, grad)
            o, _ = fla_op(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], **fla_options)
            if grad:
                o.float().sum().backward()

        cases["fla direct"] = fla_call
    return cases


def fla_interpreted() -> bool:
    """fla's kernels on CPU tensors through Triton's interpreter (make test-kernels checks this module's
    fla calls that way; only a GPU times them)."""
    from ..ops import kernels

    return kernels.fla_installed() and kernels._interpreting()


def _leaves(x: dict, grad: bool) -> dict:
    return {n: t.detach().requires_grad_(grad) for n, t in x.items()}


def time_ops(s: Settings, device: torch.device, say=print) -> list[dict]:
    rows = []
    for op in ("kda", "gdn"):
        x = op_inputs(op, s, device)
        cases = op_cases(op, x, s, device)
        for grad in (False, True):
            times = {}
            for name, call in cases.items():
                with torch.set_grad_enabled(grad):
                    times[name] = median_seconds(lambda call=call: call(grad), device, s.repeats)
            row = {
                "op": op,
                "pass": "forward+backward" if grad else "forward",
                "ms": {n: t * 1e3 for n, t in times.items()},
            }
            if "fla direct" in times:
                row["dispatch / fla"] = times["k3 (dispatch)"] / times["fla direct"]
            row["PyTorch form / dispatch"] = times["k3 PyTorch form"] / times["k3 (dispatch)"]
            rows.append(row)
            say(f"  {op} {row['pass']}: " + ", ".join(f"{n} {t:.2f} ms" for n, t in row["ms"].items()))
    return rows


# -- 3. a training step --------------------------------------------------------------------------------


def model_config(s: Settings, kind: str = "kimi-k3"):
    return get_config(kind, **(s.model if kind == "kimi-k3" else s.kimi_linear))


def peak_bf16(device: torch.device) -> tuple[str, float] | None:
    """(name, dense bf16 FLOP/s) of the GPU from k3.plan.hardware's table, where it lists the device."""
    if device.type != "cuda":
        return None
    from ..plan.hardware import GPUS

    name = torch.cuda.get_device_name(device).lower()
    for key, gpu in GPUS.items():
        if key in name:
            return key, gpu.bf16_flops
    return None


def time_train(s: Settings, device: torch.device, say=print) -> dict:
    from ..plan.costs import train_flops_per_token
    from ..training import TrainConfig, training_step
    from ..training.optim import build_optimizer
    from ..training.parallel import compile_decoder

    config = model_config(s)
    B, T = s.train
    cfg = TrainConfig(batch_size=B, seq_len=T, precision="bf16" if s.dtype == torch.bfloat16 else "fp32")
    torch.manual_seed(0)
    model = CausalLM(config).to(device)
    optimizer = build_optimizer(model, cfg)
    if s.compile:
        compile_decoder(model, fullgraph=True)
    windows = torch.randint(0, config.vocab_size, (B, T + 1), device=device)
    start = time.perf_counter()
    training_step(model, optimizer, windows, cfg)  # compiles
    first = time.perf_counter() - start
    seconds = median_seconds(lambda: training_step(model, optimizer, windows, cfg), device, s.train_steps, warmup=1)
    tokens_per_s = B * T / seconds
    flops = sum(train_flops_per_token(config, T).values())
    out = {"parameters": count_params(config).total, "active": count_params(config).active, "tokens": B * T,
           "first step s": first, "step s": seconds, "tokens/s": tokens_per_s, "FLOPs/token": flops}  # fmt: skip
    peak = peak_bf16(device)
    if peak is not None:
        out["gpu"], out["MFU"] = peak[0], tokens_per_s * flops / peak[1]
    say(
        f"  train step {seconds * 1e3:.0f} ms, {tokens_per_s:,.0f} tokens/s"
        + (f", MFU {out['MFU']:.1%}" if peak else "")
    )
    return out


# -- 4. decoding ---------------------------------------------------------------------------------------


def time_decode(s: Settings, device: torch.device, say=print) -> list[dict]:
    from ..inference.decode_step import DecodeStep

    rows = []
    for kind in ("kimi-k3", "kimi-linear"):
        torch.manual_seed(0)
        model = CausalLM(model_config(s, kind)).to(device=device, dtype=s.dtype).eval()
        hf = _transformers_kimi(model, device, s.dtype) if kind == "kimi-linear" else None
        for context in s.contexts:
            ids = torch.randint(0, model.config.vocab_size, (1, context), device=device)
            with torch.inference_mode():
                cache = model.new_cache(1, max_length=context + s.decode_steps + 8)
                model(ids, cache)
                step = DecodeStep(model, cache, compile=s.compile)
                token = ids[:, -1]
                ms = median_seconds(lambda: step(token), device, s.decode_steps) * 1e3
            row = {"model": kind, "context": context, "k3 compiled ms/token" if s.compile else "k3 ms/token": ms}
            if hf is not None:
                row["transformers ms/token"] = _time_hf(hf, ids, device, s) * 1e3
            rows.append(row)
            say(f"  decode {kind} @ {context:,}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items() if "ms" in k))
    return rows


def _transformers_kimi(model: CausalLM, device: torch.device, dtype: torch.dtype):
    """transformers' KimiLinearForCausalLM on `model`'s weights (None without transformers)."""
    from .runners import _transformers, build_hf_kimi

    transformers = _transformers()
    if transformers is None:
        return None
    return build_hf_kimi(transformers, copy.deepcopy(model).float()).to(device=device, dtype=dtype).eval()


def _time_hf(hf, ids: torch.Tensor, device: torch.device, s: Settings) -> float:
    from .runners import _cache_of

    with torch.inference_mode():
        cache = _cache_of(hf(ids, use_cache=True))
        token = ids[:, -1:]
        return median_seconds(lambda: hf(token, use_cache=True, past_key_values=cache), device, s.decode_steps)


# -- the command ---------------------------------------------------------------------------------------


def describe(s: Settings) -> list[str]:
    """What `run` would time, without running anything (`--dry-run`)."""
    from ..plan.costs import train_flops_per_token

    B, T, H, D = s.ops
    k3 = model_config(s)
    kimi = model_config(s, "kimi-linear")
    counts = count_params(k3)
    flops = sum(train_flops_per_token(k3, s.train[1]).values())
    return [
        "k3 bench gpu --dry-run: what one GPU would run (nothing is timed here)",
        "1. tests: pytest tests/ops/test_cuda.py on the device (k3's ops; fla's kernels behind them vs k3's forms)",
        f"2. ops: chunk KDA (safe gate, lower_bound -5) and Gated DeltaNet, B={B} T={T:,} H={H} K=V={D}, "
        f"{str(s.dtype).removeprefix('torch.')}, chunk {s.chunk_size}; forward and forward+backward; "
        "k3's dispatch vs fla called directly (target <= 1.05x) vs k3's PyTorch form",
        f"3. train: {k3.name} at {counts.total / 1e9:.2f} B parameters ({counts.active / 1e9:.2f} B active), "
        f"layers {k3.layer_types}, MLPs {k3.mlp_types}; {s.train[0]} x {s.train[1]:,} tokens a step, bf16 autocast, "
        f"Muon, torch.compile (fullgraph); {flops / 1e9:.1f} GFLOPs a token: tokens/s and MFU",
        f"4. decode: compiled step (CUDA graphs) at contexts {', '.join(f'{c:,}' for c in s.contexts)}, batch 1: "
        f"{k3.name}, and {kimi.name} ({count_params(kimi).total / 1e9:.2f} B) beside transformers' "
        "KimiLinearForCausalLM on the same weights",
    ]


PARTS = ("tests", "ops", "train", "decode")


def run(
    s: Settings = Settings(),
    device: str | torch.device = "cuda",
    json_path: str | None = None,
    say=print,
    parts: tuple[str, ...] = PARTS,
) -> dict:
    """The `parts` (default all, in order) on `device` (CUDA for the report; the CPU runs `TINY` in the
    tests, without "tests"); returns the report, with each part's wall seconds under "seconds" (compiles
    and kernel autotuning included) and a part that raised under "errors" (the others still run). The
    JSON is written after every part, so a run cut short keeps what it measured."""
    from .timing import write_report

    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(  # bad input, one line from the CLI: this machine has no GPU
            f"k3 bench gpu needs a CUDA GPU and this PyTorch sees none (torch.cuda.is_available() is False: no "
            f"GPU, no driver, or a CPU-only build of torch {torch.__version__}); --dry-run shows the plan"
        )
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise ValueError(f"k3 bench gpu: parts must be among {', '.join(PARTS)}, got {', '.join(parts) or 'none'}")
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type, "seconds": {}}
    say(f"k3 bench gpu on {report['device']}")
    steps = {
        "tests": lambda: run_tests(),
        "ops": lambda: time_ops(s, device, say),
        "train": lambda: time_train(s, device, say),
        "decode": lambda: time_decode(s, device, say),
    }
    for number, part in enumerate(PARTS, 1):
        if part not in parts or (part == "tests" and device.type != "cuda"):
            continue
        say(f"{number}. {part}")
        start = time.perf_counter()
        try:
            report[part] = steps[part]()
        except Exception as e:  # a device session is scarce: one part's failure does not cost the others
            report.setdefault("errors", {})[part] = f"{type(e).__name__}: {e}"
            say(f"  {part} failed: {type(e).__name__}: {e}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
        report["seconds"][part] = time.perf_counter() - start
        if part == "tests":
            say(f"  {report['tests'].get('summary') or report['tests'].get('skipped')}")
        say(f"  ({report['seconds'][part]:.0f} s)")
        if json_path:
            write_report(json_path, report, "gpu")
    say("\n".join(table(report)))
    return report


def table(report: dict) -> list[str]:
    """The report as Markdown tables (docs/benchmarks.md), of the parts it has."""
    lines = [
        f"On {report['device']}"
        + (f" ({report['tests']['summary']})" if "summary" in report.get("tests", {}) else "")
        + ":"
    ]
    if report.get("ops"):
        names = list(report["ops"][0]["ms"])
        lines += ["", "| op | pass | " + " | ".join(names) + " | dispatch / fla | PyTorch form / dispatch |"]
        lines.append("|" + " --- |" * (4 + len(names)))
        for row in report["ops"]:
            ratio = row.get("dispatch / fla")
            times = " | ".join(f"{t:.2f} ms" for t in row["ms"].values())
            ratio = "-" if ratio is None else f"{ratio:.2f}x"
            lines.append(f"| {row['op']} | {row['pass']} | {times} | {ratio} | {row['PyTorch form / dispatch']:.1f}x |")
    if "train" in report:
        t = report["train"]
        mfu = f", MFU {t['MFU']:.1%} of the {t['gpu']}'s bf16 peak" if "MFU" in t else ""
        size = f"{t['parameters'] / 1e9:.2f} B parameters ({t['active'] / 1e9:.2f} B active)"
        speed = f"{t['step s'] * 1e3:.0f} ms, {t['tokens/s']:,.0f} tokens/s{mfu}"
        lines += ["", f"Train step: {size}, {t['tokens']:,} tokens: {speed}"]
    if report.get("decode"):
        columns = list(dict.fromkeys(k for row in report["decode"] for k in row if "ms" in k))
        lines += ["", "| decode | context | " + " | ".join(columns) + " |", "|" + " --- |" * (2 + len(columns))]
        for row in report["decode"]:
            cells = ["-" if row.get(k) is None else f"{row[k]:.2f}" for k in columns]
            lines.append(f"| {row['model']} | {row['context']:,} | " + " | ".join(cells) + " |")
    for part, error in report.get("errors", {}).items():
        lines += ["", f"{part} failed: {error}"]
    if report.get("seconds"):
        lines += ["", "Wall seconds by part: " + ", ".join(f"{p} {t:.0f}" for p, t in report["seconds"].items())]
    return lines
