"""The bytes one rank sends in one training step of k3's fsdp x ep layout (`k3 train --parallel fsdp --ep N`,
one pipeline stage), by collective: the communication part of a training plan.

Counted as the algorithms that move the least (a ring all-gather or reduce-scatter, a direct
all-to-all): an all-gather of a P-byte shard over M ranks sends (M - 1) P from each rank; a
reduce-scatter of an M P-byte input sends (M - 1) P; an all-to-all sends what goes to the other ranks.
Per micro-batch:

- **FSDP all-gather**: every decoder layer's shard twice (forward, and again for its backward: FSDP2
  frees it after the forward), the root's (embeddings, final norm, head) once (it stays gathered from
  its forward to its backward); each MoE layer's routed experts, sharded over the M / ep ranks that hold
  them (a nested FSDP unit), twice. A shard is padded as FSDP2 pads it: ceil(rows / M) rows of every
  parameter.
- **FSDP reduce-scatter**: every unit's gradient once.
- **all-to-all** (ep > 1): in every MoE layer, forward: the per-rank counts, then each token's latent
  row, routing weights and expert indices once to every other rank of its ep group that holds one of
  its chosen experts, and those rows' outputs back; backward: the rows' gradients both ways (indices
  have none). Under activation recompute the forward's exchanges run again in the backward. A token
  reaches at most min(k, ep - 1) other ranks (`bound`); routed uniformly at random, on average
  (ep - 1)(1 - C(E - E/ep, k) / C(E, k)) (`uniform`).

Per step: **Muon** (`k3.training.dist_muon`) sends each sharded matrix's rows to the one rank that owns
it and the update's rows back (two all-to-alls; dense matrices over M ranks, experts over M / ep): "muon
exchange", the busiest rank's bytes (`muon_exchange_per_rank` gives each rank's); "muon all-gather
(whole)" is what gathering every matrix whole on every rank would send, for comparison. AdamW sends
nothing. The step's small all-reduces (the loss and
expert loads, the clipping norm) are left out: a few kB.

`k3 bench parallel` measures these on real processes (gloo) beside this model.
"""

from __future__ import annotations

import math

from ..models import ModelConfig
from .shapes import ModelShapes, Param, _sharded, model_shapes


def padded_shard(params: list[Param], ranks: int) -> int:
    """Values of one rank's FSDP2 shard of `params` over `ranks`, padded (ceil(rows / ranks) rows each)."""
    return sum(_sharded(params, ranks, 0).values())  # rank 0 holds the padded size: ceil(rows / ranks) rows


def other_ranks_per_token(config: ModelConfig, ep: int) -> tuple[float, int]:
    """(uniform, bound): the other ranks of its ep group a token's latent row goes to, on average under
    uniform routing and at most."""
    experts, k = config.num_experts, config.num_experts_per_tok
    if ep == 1:
        return 0.0, 0
    missed = math.comb(experts - experts // ep, k) / math.comb(experts, k)
    return (ep - 1) * (1 - missed), min(k, ep - 1)


def step_traffic(
    config: ModelConfig,
    fsdp: int,
    ep: int,
    tokens_per_rank: int,
    micro_batches: int = 1,
    optimizer: str = "muon",
    recompute: str = "none",
    weight_bytes: int = 4,
    row_bytes: int = 4,
    shapes: ModelShapes | None = None,
    gather_bytes: int | None = None,
) -> dict[str, float]:
    """Bytes one rank sends in one step (see the module) with `fsdp` ranks, experts split over `ep`,
    `tokens_per_rank` tokens in each of its `micro_batches`. `weight_bytes`: the reduced gradients' and
    Muon's gathered updates' element size (k3 train: float32); `gather_bytes`: the gathered weights'
    (default weight_bytes; 2 under `--precision bf16`, FSDP's bfloat16 param_dtype); `row_bytes`: the
    exchanged rows' (float32 on the CPU; bf16 under autocast). Returns {"fsdp all-gather",
    "fsdp reduce-scatter", "muon exchange", "muon all-gather (whole)", "all-to-all (uniform)",
    "all-to-all (bound)"}."""
    shapes = shapes or model_shapes(config)
    if fsdp % ep:
        raise ValueError(f"ep ({ep}) must divide fsdp ({fsdp})")
    efsdp = fsdp // ep
    moe_layers = [n for n in shapes.experts if n]
    held = [shapes.expert * (n // ep) for n in moe_layers]  # each MoE layer's held experts' parameters
    dense_layers = [list(ps) for ps in shapes.layers]
    if ep == 1:  # the experts stay in their layer's unit, sharded over all ranks
        dense_layers = [ps + shapes.expert * n for ps, n in zip(dense_layers, shapes.experts)]
        held = []
    root = shapes.first + shapes.last
    layer_shards = [padded_shard(ps, fsdp) for ps in dense_layers]
    expert_shards = [padded_shard(ps, efsdp) for ps in held]
    gathers = (fsdp - 1) * (2 * sum(layer_shards) + padded_shard(root, fsdp)) + (efsdp - 1) * 2 * sum(expert_shards)
    scatters = (fsdp - 1) * (sum(layer_shards) + padded_shard(root, fsdp)) + (efsdp - 1) * sum(expert_shards)
    whole, exchange = 0, 0
    if optimizer == "muon":
        dense, experts = _muon_matrices(dense_layers + [root], held)
        whole = (fsdp - 1) * sum(padded_shard([p], fsdp) for p in dense) + (efsdp - 1) * sum(
            padded_shard([p], efsdp) for p in experts
        )
        exchange = max(_muon_exchange(dense, experts, fsdp, ep, weight_bytes))
    out = {
        "fsdp all-gather": gathers * (weight_bytes if gather_bytes is None else gather_bytes) * micro_batches,
        "fsdp reduce-scatter": scatters * weight_bytes * micro_batches,
        "muon exchange": exchange,
        "muon all-gather (whole)": whole * weight_bytes,
    }
    width = config.moe_latent_size or config.hidden_size
    k = config.num_experts_per_tok
    forward_row = width * row_bytes + k * 4 + k * 8 + width * row_bytes  # latent, weights, indices; output back
    backward_row = width * row_bytes + k * 4 + width * row_bytes  # their gradients
    from ..training.parallel import SELECTIVE_EVERY

    forwards = [
        2 if recompute == "full" or (recompute == "selective" and (i + 1) % SELECTIVE_EVERY == 0) else 1
        for i, n in enumerate(shapes.experts)
        if n
    ]  # each MoE layer's forward exchanges
    for name, rows in zip(("uniform", "bound"), other_ranks_per_token(config, ep)):
        total = sum((ep - 1) * 8 * f + tokens_per_rank * rows * (f * forward_row + backward_row) for f in forwards)
        out[f"all-to-all ({name})"] = total * micro_batches if ep > 1 else 0.0
    return out


def _muon_matrices(dense_units: list[list[Param]], held: list[list[Param]]) -> tuple[list[Param], list[Param]]:
    """Muon's matrices sharded over all ranks (the dense units') and over an expert group (held experts')."""
    dense = [p for ps in dense_units for p in ps if p.kind == "matrix"]
    return dense, [p for ps in held for p in ps if p.kind == "matrix"]


def _muon_exchange(dense: list[Param], experts: list[Param], fsdp: int, ep: int, element_bytes: int) -> list[int]:
    """Each rank's bytes of distributed Muon's exchanges: rank g (mesh [fsdp / ep, ep], g = i * ep + j) is
    rank g of the dense matrices' group and rank i of its expert group's."""
    from ..training.dist_muon import exchange_bytes_per_rank

    on_dense = exchange_bytes_per_rank([p.shape for p in dense], fsdp, element_bytes)
    on_experts = exchange_bytes_per_rank([p.shape for p in experts], fsdp // ep, element_bytes) if experts else [0]
    return [on_dense[g] + on_experts[(g // ep) % len(on_experts)] for g in range(fsdp)]


def muon_exchange_per_rank(
    config: ModelConfig, fsdp: int, ep: int, element_bytes: int = 4, shapes: ModelShapes | None = None
) -> list[int]:
    """The bytes each of `fsdp` ranks sends in one step's distributed Muon exchanges (see the module)."""
    shapes = shapes or model_shapes(config)
    dense_layers = [list(ps) for ps in shapes.layers]
    held = [shapes.expert * (n // ep) for n in shapes.experts if n]
    if ep == 1:
        dense_layers = [ps + shapes.expert * n for ps, n in zip(dense_layers, shapes.experts)]
        held = []
    dense, experts = _muon_matrices(dense_layers + [shapes.first + shapes.last], held)
    return _muon_exchange(dense, experts, fsdp, ep, element_bytes)
