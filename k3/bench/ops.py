"""`k3 bench ops`: recurrent vs chunkwise mixers vs causal SDPA on one shape, in one run.

Shape: B = 1, H heads, K = V = d, float32. KDA uses Kimi K3's safe gate g = -5 * sigmoid(x) (every
per-step log decay >= -5); Gated DeltaNet the same gate with one value per head. The chunk form's
throughput is reported under the article's cost model, 2*L*d^2 + 2*L*C*d FLOPs per head (state work
plus the diagonal score blocks), beside the machine's measured matmul throughput.

Timing: every case of one sequence length is timed once per round, round after round, and each keeps
its best round. Interleaving puts every case through the same phases of a noisy shared machine, so
the ratios printed (speed-ups, fraction of SDPA time) are taken side by side
(`k3.bench.timing.interleaved_best`: no gradients, one warm-up call per case in the first round, none
for the token loops, which have nothing to warm up).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from ..ops import chunk_gated_delta_rule, chunk_kda, recurrent_gated_delta_rule, recurrent_kda
from .timing import interleaved_best, matmul_gflops, write_report

GATE_LOWER_BOUND = -5.0  # Kimi K3's safe gate, g = GATE_LOWER_BOUND * sigmoid(x): every step's g is at least it


def kda_inputs(T: int, H: int, d: int, seed: int = 0, B: int = 1, device="cpu"):
    """(q, k, v, g, beta) of B sequences as `k3 bench ops` (and `k3 bench gpu`) times them, float32, seeded,
    on `device`: q, k, v [B, T, H, d] with k L2-normalised, the safe gate g = -5 * sigmoid(x) [B, T, H, d]
    (per-step log decay >= -5; Gated DeltaNet takes its first channel) and the write strength
    beta = sigmoid(x) [B, T, H]."""
    gen = torch.Generator(device).manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    q, k, v = randn(B, T, H, d), F.normalize(randn(B, T, H, d), dim=-1), randn(B, T, H, d)
    g = GATE_LOWER_BOUND * torch.sigmoid(randn(B, T, H, d))
    beta = torch.sigmoid(randn(B, T, H))
    return q, k, v, g, beta


def _transformers_gdn():
    """Qwen3-Next's pure-torch chunked Gated DeltaNet from transformers, or None if not installed."""
    try:
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    return getattr(torch_chunk_gated_delta_rule, "__wrapped__", torch_chunk_gated_delta_rule)


def model_flops(T: int, H: int, d: int, C: int) -> float:
    """The article's chunked cost, 2*L*d^2 + 2*L*C*d, summed over heads."""
    return H * (2 * T * d * d + 2 * T * C * d)


def run(
    lengths=(512, 2048, 8192),
    chunk_sizes=(16, 32, 64, 128),
    heads: int = 8,
    dim: int = 64,
    repeats: int = 3,
    json_path: str | None = None,
    out=None,
):
    out = sys.stdout if out is None else out

    def say(line=""):
        print(line, file=out, flush=True)

    gemm = matmul_gflops()
    bgemm = matmul_gflops(batch=512, size=dim)
    say(
        f"k3 bench ops: B=1 H={heads} K=V={dim} float32, {torch.get_num_threads()} threads, "
        f"best of {repeats} interleaved rounds"
    )
    say(f"machine matmul: {gemm:.1f} GFLOP/s (1024^3 GEMM), {bgemm:.1f} GFLOP/s (512 x {dim}^3 batched)")
    hf_gdn = _transformers_gdn()
    if hf_gdn is None:
        say("transformers not installed: skipping its torch_chunk_gated_delta_rule (pip install 'k3[hf]')")
    mixers = {
        "kda": (recurrent_kda, chunk_kda),
        "gated_delta_rule": (recurrent_gated_delta_rule, chunk_gated_delta_rule),
    }
    results = []
    for T in lengths:
        q, k, v, g, beta = kda_inputs(T, heads, dim)
        gates = {"kda": g, "gated_delta_rule": g[..., 0].contiguous()}
        qh, kh, vh = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        cases = {"sdpa": lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)}
        for name, (_, chunk) in mixers.items():
            for C in chunk_sizes:
                cases[f"{name}/chunk/{C}"] = lambda chunk=chunk, gate=gates[name], C=C: chunk(
                    q, k, v, gate, beta, chunk_size=C
                )
        if hf_gdn is not None:
            gh = gates["gated_delta_rule"]
            cases["transformers_gdn"] = lambda: hf_gdn(q, k, v, gh, beta, chunk_size=64)
        for name, (rec, _) in mixers.items():
            cases[f"{name}/recurrent"] = lambda rec=rec, gate=gates[name]: rec(q, k, v, gate, beta)
        times = interleaved_best(cases, repeats, cold=frozenset(f"{name}/recurrent" for name in mixers))

        sdpa = times["sdpa"]
        row = {"T": T, "sdpa_s": sdpa, "ops": {}}
        say(f"\nT = {T}: causal SDPA {sdpa * 1e3:.1f} ms")
        for name in mixers:
            rec_s = times[f"{name}/recurrent"]
            entry = {"recurrent_s": rec_s, "chunk_s": {}}
            say(f"  {name:17s} recurrent {rec_s * 1e3:.0f} ms")
            for C in chunk_sizes:
                t = times[f"{name}/chunk/{C}"]
                entry["chunk_s"][C] = t
                gflops = model_flops(T, heads, dim, C) / t / 1e9
                say(
                    f"    chunk C={C:<4d} {t * 1e3:8.1f} ms  {rec_s / t:6.1f}x vs recurrent  "
                    f"{t / sdpa:5.2f}x SDPA time  {gflops:5.1f} GFLOP/s (model)"
                )
            if name == "gated_delta_rule" and hf_gdn is not None:
                t = times["transformers_gdn"]
                entry["transformers_chunk_s"] = t
                ours = entry["chunk_s"].get(64, min(entry["chunk_s"].values()))
                say(
                    f"    transformers torch_chunk_gated_delta_rule C=64 {t * 1e3:8.1f} ms  "
                    f"(k3 chunk C=64 is {t / ours:.1f}x faster)"
                )
            row["ops"][name] = entry
        results.append(row)
    if json_path:
        write_report(json_path, {"gemm_gflops": gemm, "batched_gemm_gflops": bgemm, "results": results}, "ops")
    return results
