"""`k3 plan --serve`: weight bytes, cache bytes per sequence at a context, sequences per node, and the
decode speed the memory bandwidth allows.

Weights: bf16 throughout, or the routed experts in MXFP4 (OCP Microscaling: 4-bit E2M1 codes plus one
E8M0 scale byte per block of 32 weights along the input dimension, 4.25 bits a weight) and the rest bf16,
as Kimi K3 is published. Caches: the same accounting as `k3 params` (MLA latents and MHA keys and
values in bf16 per token, the linear family's fp32 states per sequence).

A replica is the GPUs that hold one copy of the weights (by default the fewest whole 8-GPU nodes that
hold the weights and one sequence's cache in their usable memory); what is left holds sequences.
Decoding a step of B sequences reads the dense weights once, the routed experts the batch chooses
(E (1 - (1 - k/E)^B) per MoE layer, routing taken as uniform and independent), and every sequence's
cache (the linear states also written back; of the embedding table only a row), spread over the replica's
GPUs at their HBM bandwidth; its compute, at the GPUs' dense bf16 peak, bounds it from the other side (a
roofline: the slower of the two). Interconnect, kernel efficiency and prefill are left out, so the figures
are upper bounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..models import ModelConfig, count_params
from .costs import decode_flops_per_token
from .figures import Figures
from .hardware import GPUS, GPUS_PER_NODE
from .shapes import ModelShapes, model_shapes

EXPERT_FORMATS = ("bf16", "mxfp4")
MX_BLOCK = 32  # weights per E8M0 scale


@dataclass(frozen=True)
class ServeSettings:
    gpu: str = "h200"
    gpus: int | None = None  # per replica; None: the fewest whole nodes that hold the weights
    context: int = 1 << 20
    experts: str = "mxfp4"
    concurrent: int | None = None  # sequences decoded together; None: as many as fit


def mxfp4_bytes(shape: tuple[int, ...]) -> int:
    """Bytes of one matrix [rows, cols] in MXFP4: 16 code bytes and 1 scale byte per 32-weight block."""
    rows, cols = shape
    return rows * math.ceil(cols / MX_BLOCK) * (MX_BLOCK // 2 + 1)


def weight_bytes(config: ModelConfig, shapes: ModelShapes, experts: str) -> dict[str, float]:
    """Bytes of the weights by part: the routed experts (in `experts` format) and the rest (bf16)."""
    if experts not in EXPERT_FORMATS:
        raise ValueError(f"--experts must be one of {', '.join(EXPERT_FORMATS)}, got {experts!r}")
    routed = sum(shapes.experts)
    per_expert = sum(2 * p.numel if experts == "bf16" else mxfp4_bytes(p.shape) for p in shapes.expert)
    rest = count_params(config).total - routed * sum(p.numel for p in shapes.expert)
    return {f"routed experts ({experts})": float(routed * per_expert), "everything else (bf16)": 2.0 * rest}


def cache_bytes(config: ModelConfig, context: int) -> dict[str, float]:
    """Decode memory of one sequence at `context` tokens, by part (`count_params`' accounting)."""
    pc = count_params(config)
    out = {}
    if pc.mla_cache_bytes_per_token:
        out["MLA latent cache"] = float(pc.mla_cache_bytes_per_token * context)
    if pc.kv_cache_bytes_per_token:
        out["MHA KV cache"] = float(pc.kv_cache_bytes_per_token * context)
    if pc.recurrent_state_bytes_per_sequence:
        out["recurrent states"] = float(pc.recurrent_state_bytes_per_sequence)
    return out


def plan_serving(config: ModelConfig, s: ServeSettings, shapes: ModelShapes | None = None) -> Figures:
    """The serving plan of `config` under `s`."""
    if s.gpu not in GPUS:
        raise ValueError(f"--gpu must be one of {', '.join(GPUS)}, got {s.gpu!r}")
    if s.context < 1:
        raise ValueError(f"--context must be >= 1, got {s.context}")
    gpu, shapes = GPUS[s.gpu], shapes or model_shapes(config)
    weights = weight_bytes(config, shapes, s.experts)
    cache = cache_bytes(config, s.context)
    w, per_seq = sum(weights.values()), sum(cache.values())
    gpus = s.gpus or GPUS_PER_NODE * math.ceil((w + per_seq) / (GPUS_PER_NODE * gpu.usable_bytes))
    if gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {gpus}")
    fit = math.floor((gpus * gpu.usable_bytes - w) / per_seq) if per_seq else 0
    batch = s.concurrent or max(fit, 1)
    f = Figures(f"k3 plan --serve {config.name}: {gpu.name} ({gpu.source})")
    f.inputs = {
        "gpu": gpu.name,
        "gpus per replica": gpus,
        "context": s.context,
        "experts": s.experts,
        "concurrent": batch,
    }
    f.chosen = [name for name, v in (("gpus per replica", s.gpus), ("concurrent", s.concurrent)) if v is None]
    for name, value in weights.items():
        f.add(f"weights: {name}", value, "bytes")
    f.add("weights", w, "bytes")
    for name, value in cache.items():
        f.add(f"cache per sequence: {name}", value, "bytes")
    f.add("cache per sequence", per_seq, "bytes")
    f.add("usable memory per replica", gpus * gpu.usable_bytes, "bytes")
    f.add("sequences per replica", max(fit, 0), "sequences")
    f.add("sequences per node", max(fit, 0) * GPUS_PER_NODE / gpus, "sequences/node")
    if fit < 1 or batch > fit:
        f.notes.append(
            f"DOES NOT FIT: {gpus} x {gpu.name} hold {gpus * gpu.usable_bytes / 1e9:,.0f} GB usable; "
            f"the weights need {w / 1e9:,.0f} GB and {batch} sequence(s) {batch * per_seq / 1e9:,.1f} GB "
            f"more; use more --gpus or fewer --concurrent"
        )
    flops = decode_flops_per_token(config, s.context)
    for name, value in flops.items():
        f.add(f"decode FLOPs per token: {name}", value, "FLOP")
    f.add("decode FLOPs per token", sum(flops.values()), "FLOP")
    for b, label in ((1, "one sequence alone"), (batch, f"{batch} sequences together")):
        read = _step_bytes(config, shapes, weights, cache, b)
        memory_s = read / (gpus * gpu.hbm_bytes_per_s)
        compute_s = b * sum(flops.values()) / (gpus * gpu.bf16_flops)
        f.add(f"decode step, {label}: bytes read", read, "bytes")
        f.add(f"decode step, {label}: bandwidth-bound time", memory_s, "s")
        f.add(f"decode step, {label}: compute-bound time", compute_s, "s")
        f.add(f"decode, {label}: tokens/s per sequence", 1 / max(memory_s, compute_s), "tokens/s")
        f.add(f"decode, {label}: tokens/s per replica", b / max(memory_s, compute_s), "tokens/s")
    return f


def _step_bytes(config: ModelConfig, shapes: ModelShapes, weights: dict, cache: dict, batch: int) -> float:
    """Bytes one decode step of `batch` sequences reads (see the module docstring)."""
    routed = next((v for k, v in weights.items() if k.startswith("routed")), 0.0)
    # every weight but the routed experts, less the embedding tables (a lookup reads one row) unless
    # tied to the output head
    lookups = 0 if config.tie_word_embeddings else sum(2 * p.numel for p in shapes.first)
    dense = sum(weights.values()) - routed - lookups
    moe_layers = sum(1 for n in shapes.experts if n)
    if moe_layers:
        E, k = config.num_experts, config.num_experts_per_tok
        touched = E * (1 - (1 - k / E) ** batch)
        dense += routed / (moe_layers * E) * touched * moe_layers
    per_seq = sum(cache.values()) + cache.get("recurrent states", 0.0)  # states are read and written
    return dense + batch * per_seq
