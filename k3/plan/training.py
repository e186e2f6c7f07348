"""`k3 plan --train`: memory per GPU by part, FLOPs per token, step time and GPU-hours at an assumed MFU,
and, when the plan does not fit, the smallest change that does.

Memory per GPU (the worst rank, the first of its pipeline stage, whose FSDP shards are the largest):

- parameters: fp32 master weights, sharded (`k3.plan.shapes`: exact per-rank values);
- gradients: fp32 (FSDP2's reduce dtype), sharded alike;
- optimizer state: Muon's (the default, as `k3 train`'s and as Kimi trains) one fp32 momentum on the
  matrices (routed experts included) and AdamW's two on the embeddings, head and vectors (Moonlight's
  split); with `--optimizer adamw`, AdamW's two fp32 moments on everything;
- FSDP all-gather buffers: the largest FSDP unit unsharded, twice in bf16 (the layer computing and the
  one prefetched) and once in fp32 (its gradient before the reduce-scatter);
- activations: one micro-batch's (`k3.plan.costs`), times the micro-batches a stage holds at once under
  1F1B pipelining (pp - stage);
- MoE dispatch buffers: k3's expert parallelism sends each token (latent z, its chosen experts and
  weights) once to every rank of the ep group that owns one of its experts, by all-to-all, and gets one
  row back from each: at most min(k, ep) rows per token received and returned, two [min(k, ep) x
  tokens, width] bf16 tensors for one layer at a time (an upper bound: a token whose experts share a
  rank travels less);
- Muon's step (`muon_step_bytes`): the exchange's buffers, the owned matrices whole and Newton-Schulz's
  workspace, counted beyond the activations, which are freed by then.

Communication (one pipeline stage): the bytes each GPU sends in a step by collective — FSDP2's all-gathers
and reduce-scatters of k3 train's float32 weights and gradients, distributed Muon's exchange, the MoE
all-to-alls — as `k3.plan.traffic` counts them (`k3 bench parallel` measures the same on gloo
processes and finds the FSDP and Muon bytes exact, the all-to-all within 1% of its uniform-routing value).

Time: step = compute + exposed communication. Compute = global batch tokens x FLOPs per token / (GPUs x
dense peak x MFU), stretched by the pipeline bubble (pp - 1) / (micro-batches + pp - 1); MFU counts the
model's FLOPs only (recomputation is one of the costs an assumed MFU absorbs). Exposed communication
(one pipeline stage; `k3.plan.communication`): each collective's bytes over NVLink or the network, less
what compute hides (FSDP's prefetched gathers, the all-to-alls behind the shared experts). The step's
MFU, tokens per day and GPU-hours follow from the sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..models import ModelConfig, count_params
from .communication import exposed_communication
from .costs import RECOMPUTE, activation_bytes_per_token, train_flops_per_token
from .figures import Figures
from .hardware import GPUS, Gpu, get_gpu
from .shapes import Layout, ModelShapes, model_shapes, rank_values, unsharded_layer_values
from .traffic import step_traffic

OPTIMIZERS = ("adamw", "muon")
DEFAULT_MFU = 0.40  # DeepSeek-V3's implied MFU on bf16 peak (k3.plan.published); about what large MoE runs report
MAX_EP = 64  # the planner's default ep: DeepSeek-V3's EP64 (8 nodes)


@dataclass(frozen=True)
class TrainSettings:
    gpus: int = 8
    gpu: str = "h200"
    pp: int | None = None
    fsdp: int | None = None
    ep: int | None = None
    seq_len: int = 4096
    global_batch_tokens: int | None = None
    micro_batch: int = 1  # sequences per micro-batch
    optimizer: str = "muon"  # k3 train's default, as Kimi K2 and K3 train (MuonClip)
    precision: str = "bf16"
    mfu: float = DEFAULT_MFU
    recompute: str | None = None  # None: the least that fits


def default_ep(config: ModelConfig, fsdp: int) -> int:
    """The largest expert split up to MAX_EP that divides both the experts and the stage's ranks."""
    if "moe" not in config.mlp_types:
        return 1
    return max(e for e in range(1, MAX_EP + 1) if config.num_experts % e == 0 and fsdp % e == 0)


def layout_of(config: ModelConfig, s: TrainSettings) -> Layout:
    """The layout `s` asks for; the one of --pp and --fsdp not given is --gpus over the other, which must
    divide it (a ValueError naming the flag that was given)."""
    for flag, given, other in (("--pp", s.pp, s.fsdp), ("--fsdp", s.fsdp, s.pp)):
        if given and not other and s.gpus % given:
            missing = "--fsdp" if flag == "--pp" else "--pp"
            raise ValueError(f"{flag} ({given}) must divide --gpus ({s.gpus}): {missing} is --gpus / {flag}")
    pp = s.pp or (s.gpus // s.fsdp if s.fsdp else 1)
    fsdp = s.fsdp or s.gpus // pp
    layout = Layout(s.gpus, pp, fsdp, s.ep or default_ep(config, fsdp))
    layout.check(config)
    return layout


def memory(config: ModelConfig, shapes: ModelShapes, layout: Layout, s: TrainSettings, recompute: str) -> dict:
    """Bytes on the fullest GPU by part (see the module docstring)."""
    worst: dict[str, float] = {}
    tokens = s.micro_batch * s.seq_len
    for stage in range(layout.pp):
        held = rank_values(shapes, layout, stage * layout.fsdp)
        n = sum(held.values())
        adam_only = held.get("embedding", 0) + held.get("vector", 0)
        optimizer = 8 * n if s.optimizer == "adamw" else 4 * (n - adam_only) + 8 * adam_only
        layers = layout.stage_layers(config.num_layers, stage)
        per_token = sum(activation_bytes_per_token(config, layers, recompute).values())
        parts = {
            "parameters (fp32, sharded)": 4.0 * n,
            "gradients (fp32, sharded)": 4.0 * n,
            f"optimizer state ({s.optimizer})": float(optimizer),
            "FSDP all-gather buffers": 8.0 * unsharded_layer_values(shapes, layout),
            "activations": tokens * per_token * (layout.pp - stage),
        }
        if any(config.mlp_types[i] == "moe" for i in layers):
            width = config.moe_latent_size or config.hidden_size
            visits = min(config.num_experts_per_tok, layout.ep)  # ranks a token is sent to, at most
            parts["MoE dispatch buffers"] = tokens * visits * (4.0 * width + 12 * config.num_experts_per_tok)
        if s.optimizer == "muon":
            transient = muon_step_bytes(n - adam_only)  # while the step's activations are freed
            parts[MUON_STEP] = max(0.0, transient - parts["activations"] - parts.get("MoE dispatch buffers", 0.0))
        if sum(parts.values()) > sum(worst.values()):
            worst = parts
    return worst


MUON_STEP = "Muon step beyond the freed activations"


def muon_step_bytes(matrix_values: float) -> float:
    """Bytes distributed Muon's step holds besides the weights, gradients and momenta (`k3.training.dist_muon`):
    on a rank whose shards hold `matrix_values` matrix values (its owned matrices about as many, balanced
    by size) two float32 buffers of them at once (sent and received, received and the updates, ...), and
    Newton-Schulz's workspace on one stack of at most STACK_VALUES values (the float32 stack and three
    bfloat16 iterates). It runs after the backward, when the activations are freed: the plan counts what
    exceeds them."""
    from ..training.muon import STACK_VALUES

    return 8.0 * matrix_values + 10.0 * min(STACK_VALUES, matrix_values)


def _fits(config, shapes, layout, s, recompute, gpu: Gpu) -> tuple[bool, float]:
    total = sum(memory(config, shapes, layout, s, recompute).values())
    return total <= gpu.usable_bytes, total


def plan_training(config: ModelConfig, s: TrainSettings, shapes: ModelShapes | None = None) -> Figures:
    """The training plan of `config` under settings `s` (unset ones chosen and marked as such)."""
    for name, value, allowed in (("optimizer", s.optimizer, OPTIMIZERS), ("recompute", s.recompute, RECOMPUTE)):
        if value is not None and value not in allowed:
            raise ValueError(f"--{name} must be one of {', '.join(allowed)}, got {value!r}")
    if not 0 < s.mfu <= 1:
        raise ValueError(f"--mfu must be in (0, 1], got {s.mfu}")
    for name in ("seq_len", "micro_batch"):
        if getattr(s, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(s, name)}")
    gpu = get_gpu(s.gpu)
    peak = gpu.peak_flops(s.precision)
    shapes = shapes or model_shapes(config)
    layout = layout_of(config, s)
    chosen = [
        name
        for name, v in (
            ("pp", s.pp),
            ("fsdp", s.fsdp),
            ("ep", s.ep),
            ("recompute", s.recompute),
            ("global batch tokens", s.global_batch_tokens),
        )
        if v is None
    ]
    recompute = s.recompute or next((r for r in RECOMPUTE if _fits(config, shapes, layout, s, r, gpu)[0]), "full")
    micro_tokens = s.micro_batch * s.seq_len
    micro_batches = max(1, math.ceil((s.global_batch_tokens or 0) / (layout.fsdp * micro_tokens)))
    batch = micro_batches * layout.fsdp * micro_tokens
    if s.global_batch_tokens is not None and batch != s.global_batch_tokens:
        notes = [
            f"global batch: --global-batch-tokens {s.global_batch_tokens:,} rounded up to {batch:,}, whole "
            f"micro-batches ({micro_batches} a rank of {s.micro_batch} x {s.seq_len} tokens) on each of "
            f"{layout.fsdp} FSDP ranks"
        ]
    else:
        notes = []
    f = Figures(f"k3 plan --train {config.name}: {layout.gpus} x {gpu.name} ({gpu.source})")
    f.inputs = {
        "gpus": layout.gpus,
        "gpu": gpu.name,
        "pp": layout.pp,
        "fsdp": layout.fsdp,
        "ep": layout.ep,
        "seq len": s.seq_len,
        "micro-batch": f"{s.micro_batch} x {s.seq_len} tokens",
        "global batch tokens": batch,
        "optimizer": s.optimizer,
        "precision": s.precision,
        "mfu": s.mfu,
        "recompute": recompute,
    }
    f.chosen = chosen
    f.notes += notes
    pc = count_params(config)
    f.add("parameters", pc.total, "count")
    f.add("active parameters per token", pc.active, "count")
    f.add("parameter values on rank 0", sum(rank_values(shapes, layout, 0).values()), "count")
    parts = memory(config, shapes, layout, s, recompute)
    for name, value in parts.items():
        f.add(f"memory: {name}", value, "bytes")
    total = f.add("memory per GPU", sum(parts.values()), "bytes")
    f.add("usable memory per GPU", gpu.usable_bytes, "bytes")
    fits = total <= gpu.usable_bytes
    f.add("fits", float(fits), "bool")
    flops = train_flops_per_token(config, s.seq_len)
    for name, value in flops.items():
        f.add(f"FLOPs per token: {name}", value, "FLOP")
    per_token = f.add("FLOPs per token", sum(flops.values()), "FLOP")
    bubble = (layout.pp - 1) / (micro_batches + layout.pp - 1)
    f.add("micro-batches per step per rank", micro_batches, "micro-batches")
    f.add("pipeline bubble", bubble, "fraction")
    compute = f.add("step time: compute", batch * per_token / (layout.gpus * peak * s.mfu) / (1 - bubble), "s")
    exposed = 0.0
    if layout.pp == 1:  # bytes each GPU sends in a step (k3.plan.traffic), as k3 train runs it, and their time
        compute_bytes = 2 if s.precision == "bf16" else 4  # the gathered weights and exchanged rows
        traffic = step_traffic(
            config,
            layout.fsdp,
            layout.ep,
            micro_tokens,
            micro_batches,
            s.optimizer,
            recompute,
            weight_bytes=4,
            row_bytes=compute_bytes,
            shapes=shapes,
            gather_bytes=compute_bytes,
        )
        for name, value in traffic.items():
            f.add(f"sent per GPU per step: {name}", value, "bytes")
        for name, value in exposed_communication(config, traffic, layout, gpu, compute, per_token).items():
            f.add(f"communication {name}", value, "s")
        exposed = f["communication exposed communication"]
    step = f.add("step time", compute + exposed, "s")
    f.add("MFU with communication", s.mfu * compute / step, "fraction")
    f.add("tokens per day", batch / step * 86400, "tokens")
    f.add("GPU-hours per trillion tokens", layout.gpus * step / batch * 1e12 / 3600, "GPU-hours")
    if not fits:
        f.notes.append(
            f"DOES NOT FIT: {total / 1e9:,.1f} GB per GPU, {gpu.usable_bytes / 1e9:,.1f} GB usable "
            f"({gpu.memory_bytes / 1e9:.0f} GB x 0.9)."
        )
        f.notes += smallest_changes(config, shapes, s, layout, recompute, gpu)
    else:
        f.notes += train_command(config, s, layout, recompute, micro_batches)
    return f


def train_command(
    config: ModelConfig, s: TrainSettings, layout: Layout, recompute: str, micro_batches: int
) -> list[str]:
    """The `torchrun ... -m k3 train` command line that runs this layout (8 GPUs a node), or why none
    does: k3 train shards over all ranks (fsdp, with --ep inside it) and has no pipeline stages or fp8."""
    from ..models import PRESETS

    if layout.pp > 1:
        return [
            f"k3 train has no pipeline parallelism: this layout (pp {layout.pp}) is not runnable by it; "
            f"with --pp 1 it would shard over all {layout.gpus} GPUs"
        ]
    if s.precision != "bf16":
        return [f"k3 train runs bf16 autocast, not {s.precision}: plan with --precision bf16 for its command"]
    nodes, per_node = (math.ceil(layout.gpus / 8), 8) if layout.gpus > 8 else (1, layout.gpus)
    preset = config.name if config.name in PRESETS else None
    flags = [
        f"--preset {preset}" if preset else "--preset PRESET --set ... (this config's fields)",
        "--parallel fsdp",
        *([f"--ep {layout.ep}"] if layout.ep > 1 else []),
        f"--recompute {'full' if recompute == 'selective' else recompute}",
        f"--seq-len {s.seq_len}",
        f"--batch-size {s.micro_batch * layout.gpus}",
        *([f"--grad-accum {micro_batches}"] if micro_batches > 1 else []),
        f"--optimizer {s.optimizer}",
        "--precision bf16",
        "--device cuda",
    ]
    lines = [f"run it: torchrun --nnodes={nodes} --nproc_per_node={per_node} -m k3 train {' '.join(flags)}"]
    if recompute == "selective":
        lines.append(
            "(k3 train's --recompute selective recomputes every 2nd layer, not the plan's op-level "
            "selective; full keeps less)"
        )
    return lines


def smallest_changes(config, shapes, s: TrainSettings, layout: Layout, recompute: str, gpu: Gpu) -> list[str]:
    """The first change that fits without more hardware (in the order: more recomputation, a smaller
    micro-batch, a larger ep, pipeline stages, Muon), and the fewest GPUs (doublings) and the smallest
    GPU type that fit with the rest as it is."""
    fixed = dict(pp=layout.pp, fsdp=layout.fsdp, ep=layout.ep)
    free: list[tuple[str, TrainSettings, str]] = []
    for r in RECOMPUTE[RECOMPUTE.index(recompute) + 1 :]:
        free.append((f"--recompute {r}", replace(s, **fixed), r))
    micro = s.micro_batch
    while micro > 1:
        micro //= 2
        free.append((f"--micro-batch {micro}", replace(s, **fixed, micro_batch=micro), recompute))
    for ep in range(layout.ep + 1, layout.fsdp + 1):
        if layout.fsdp % ep == 0 and "moe" in config.mlp_types and config.num_experts % ep == 0:
            free.append((f"--ep {ep}", replace(s, pp=layout.pp, fsdp=layout.fsdp, ep=ep), recompute))
    pp = layout.pp * 2
    while pp <= min(layout.gpus, config.num_layers):
        if layout.gpus % pp == 0:
            fsdp = layout.gpus // pp
            free.append((f"--pp {pp} --fsdp {fsdp}", replace(s, pp=pp, fsdp=fsdp, ep=None), recompute))
        pp *= 2
    if s.optimizer == "adamw":
        free.append(("--optimizer muon", replace(s, **fixed, optimizer="muon"), recompute))
    lines = []
    for text, settings, r in free:
        try:
            candidate = layout_of(config, settings)
        except ValueError:
            continue
        ok, total = _fits(config, shapes, candidate, settings, r, gpu)
        if ok:
            lines.append(f"smallest change that fits on the same GPUs: {text} ({total / 1e9:,.1f} GB per GPU)")
            break
    else:
        lines.append(f"no change of recomputation, micro-batch, ep, pp or optimizer fits on these {layout.gpus} GPUs")
    for times in (2**k for k in range(1, 11)):
        settings = replace(s, gpus=layout.gpus * times, fsdp=layout.fsdp * times, pp=layout.pp, ep=None)
        candidate = layout_of(config, settings)
        ok, total = _fits(config, shapes, candidate, settings, recompute, gpu)
        if ok:
            lines.append(
                f"fewest GPUs that fit: --gpus {candidate.gpus} (ep {candidate.ep}, recompute {recompute}: "
                f"{total / 1e9:,.1f} GB per GPU)"
            )
            break
    for other in sorted(GPUS.values(), key=lambda g: g.memory_bytes):
        if other.memory_bytes > gpu.memory_bytes:
            if _fits(config, shapes, layout, replace(s, **fixed), recompute, other)[0]:
                lines.append(f"or a GPU with more memory: --gpu {other.name} ({other.memory_bytes / 1e9:.0f} GB)")
                break
    if len(lines) == 1:
        lines.append("nor up to 1024 times the GPUs, nor another GPU type")
    return lines
