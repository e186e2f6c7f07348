"""`k3 bench backward`: the delta family's own chunkwise backward against autograd through the forward.

For chunk KDA, Gated DeltaNet and DeltaNet (q/k normalisation inside the op, kimi-k3-tiny's KDA shape by
default: H = 4, K = V = 32, chunk 64, float32), at B = 8, T = 256 (a kimi-k3-tiny training batch) and
B = 1, T = 8,192: the forward alone (no gradients), forward + backward with `k3.ops.chunk.ChunkDelta`,
and forward + backward by autograd through the forward's ops (`autograd_through_forward`), all timed
round after round in one run (`interleaved_best`) and reported as multiples of the forward. Then the
peak memory of forward + backward at T = 16,384, each way in a fresh interpreter (the rise of its peak
resident set, reset through /proc/self/clear_refs after a small warm-up call, over its resident set
then; Linux), as the ratio of the two.

Inputs: q, v ~ N(0, 1), k L2-normalised by the op, Kimi K3's safe gate g = -5 sigmoid(x), beta =
sigmoid(x), a random upstream gradient on o.
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from ..ops import chunk_delta_rule, chunk_gated_delta_rule, chunk_kda
from ..ops.chunk import autograd_through_forward
from .timing import interleaved_best, matmul_gflops, write_report

OPS = ("kda", "gated_delta_rule", "delta_rule")


def inputs(op: str, B: int, T: int, H: int, d: int, seed: int = 0) -> dict:
    """The op's keyword arguments (each tensor requiring grad) and an upstream gradient `do`."""
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    args = {"q": randn(B, T, H, d), "k": randn(B, T, H, d), "v": randn(B, T, H, d)}
    if op == "kda":
        args["g"] = -5.0 * torch.sigmoid(randn(B, T, H, d))
    elif op == "gated_delta_rule":
        args["g"] = -5.0 * torch.sigmoid(randn(B, T, H))
    args["beta"] = torch.sigmoid(randn(B, T, H))
    args = {name: x.requires_grad_() for name, x in args.items()}
    return {"args": args, "do": randn(B, T, H, d)}


def _run(op: str, args: dict, chunk_size: int):
    fn = {"kda": chunk_kda, "gated_delta_rule": chunk_gated_delta_rule, "delta_rule": chunk_delta_rule}[op]
    return fn(**args, use_qk_l2norm=True, chunk_size=chunk_size)[0]


def cases(op: str, B: int, T: int, H: int, d: int, chunk_size: int) -> dict:
    """forward / own backward / autograd backward of one op and shape, as timing cases."""
    made = inputs(op, B, T, H, d)
    args, do = made["args"], made["do"]

    def forward():
        with torch.no_grad():
            _run(op, args, chunk_size)

    def own():
        _run(op, args, chunk_size).backward(do)

    def autograd():
        with autograd_through_forward():
            _run(op, args, chunk_size).backward(do)

    return {"forward": forward, "own": own, "autograd": autograd}


def _resident(field: str) -> int:
    """VmRSS (the resident set now) or VmHWM (its peak) of this process, in bytes (Linux)."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_memory(op: str, way: str, T: int, H: int, d: int, chunk_size: int) -> float:
    """Bytes the peak resident set of a fresh interpreter rises by over one forward + backward of `op` at
    B = 1, T ('own' or 'autograd' backward)."""
    code = (
        "import contextlib, json, torch\n"
        "from k3.bench.backward import inputs, _run, _resident\n"
        "from k3.ops.chunk import autograd_through_forward\n"
        f"op, way, T, H, d, C = {op!r}, {way!r}, {T}, {H}, {d}, {chunk_size}\n"
        "warm = inputs(op, 1, 2 * C, H, d)\n"
        "_run(op, warm['args'], C).backward(warm['do'])\n"
        "made = inputs(op, 1, T, H, d)\n"
        "open('/proc/self/clear_refs', 'w').write('5')  # the peak resident set starts again from now\n"
        "base = _resident('VmRSS')\n"
        "with (autograd_through_forward() if way == 'autograd' else contextlib.nullcontext()):\n"
        "    _run(op, made['args'], C).backward(made['do'])\n"
        "print(json.dumps(_resident('VmHWM') - base))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def run(
    shapes=((8, 256), (1, 8192)),
    memory_T: int = 16384,
    heads: int = 4,
    dim: int = 32,
    chunk_size: int = 64,
    rounds: int = 15,
    ops=OPS,
    json_path: str | None = None,
    out=None,
) -> dict:
    out = sys.stdout if out is None else out

    def say(line=""):
        print(line, file=out, flush=True)

    gemm = matmul_gflops()
    say(
        f"k3 bench backward: H={heads} K=V={dim} C={chunk_size} float32, {torch.get_num_threads()} threads, "
        f"best of {rounds} interleaved rounds; machine matmul {gemm:.0f} GFLOP/s (1024^3 float32)"
    )
    results: dict = {"gemm_gflops": gemm, "time": {}, "memory": {}}
    for op in ops:
        for B, T in shapes:
            times = interleaved_best(cases(op, B, T, heads, dim, chunk_size), rounds, grad=True)
            fwd = times["forward"]
            results["time"][f"{op}/B{B}/T{T}"] = times
            say(
                f"  {op:17s} B={B} T={T:<6d} forward {fwd * 1e3:7.1f} ms   forward + backward: "
                f"own {times['own'] / fwd:4.2f}x   autograd through the forward {times['autograd'] / fwd:4.2f}x"
            )
    if memory_T:
        say(f"peak memory of forward + backward at B=1, T={memory_T} (fresh interpreters):")
        for op in ops:
            own, auto = (peak_memory(op, way, memory_T, heads, dim, chunk_size) for way in ("own", "autograd"))
            results["memory"][op] = {"own": own, "autograd": auto}
            ratio = f"ratio {own / auto:.2f}" if auto > 0 else "(too small to measure)"
            say(f"  {op:17s} own {own / 2**20:6.1f} MiB   autograd {auto / 2**20:6.1f} MiB   {ratio}")
    if json_path:
        write_report(json_path, results, "backward")
    return results
