"""Parallelism applied to a CausalLM from outside, as torchtitan does: the model code is written for
one device, and `parallelize(model, mode, device)` wraps or shards it for the processes of a torchrun
job (the default process group), the same CausalLM on every process to begin with.

- **ddp**: every rank holds the whole model; DistributedDataParallel averages the gradients during
  the backward pass.
- **fsdp**: FSDP2 `fully_shard` on every decoder layer, then on the root: each rank stores 1/N of the
  parameters, gradients and AdamW moments and all-gathers a layer's weights just before using them.
- **ep**: expert parallelism. Rank r owns the routed experts [r E/N, (r+1) E/N) of every MoE layer (the
  other entries of `experts` are None) and replicates everything else. In each MoE layer a token is
  sent once to each rank that owns one of its chosen experts and nowhere else (an all-to-all with
  per-rank counts, the dispatch of DeepSeek-V3, torchtitan and Megatron), that rank returns the
  token's weighted sum over its own chosen experts, and a second all-to-all brings those rows home,
  where they are summed. A token travels to at most min(k, R) - 1 other ranks (R ranks, top-k), so the
  traffic per rank is bounded by k whatever R; an all-gather of every token grows with R. Both
  exchanges are forward hooks on the MoE layer's `RoutedExperts`, which the model does not know
  about; backward runs them in reverse.

What the training step does about gradients in each mode is k3.training.distributed's part.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..layers.norm import upcast
from ..models import CausalLM
from ..ops.common import cast


def parallelize(model: CausalLM, mode: str, device: torch.device, ep: int = 1) -> nn.Module:
    """Split `model` (on `device`) over the processes for `mode` ("ddp", "fsdp" or "ep"); returns the
    module to call in training: the DDP wrapper, or `model` itself, sharded in place.

    A model on the meta device (built there: no process holds it whole) is split first and then
    materialised, each process allocating and initialising only what it holds (`CausalLM.reset_parameters`
    draws each parameter's values from its name, so every shard gets the one-process values); a model
    with weights (a resumed run's) is made the same on every process from rank 0's.

    fsdp with `ep` N > 1 (`--parallel fsdp --ep N`, torchtitan's composition): one DeviceMesh [world/N
    ("efsdp"), N ("ep")]; the dense parameters are sharded over all ranks (the mesh flattened), every
    MoE layer's routed experts are split over the N ranks of an ep group (the tokens exchanged by
    all-to-all within it) and each expert is sharded over the world/N ranks that hold it (a nested
    `fully_shard(moe.experts, mesh=efsdp)`). An expert's gradient on its ranks sums the tokens of its ep
    group; the reduce-scatter over efsdp sums the groups, divided by the world size: the mean gradient,
    as the dense parameters' is."""
    if mode not in ("ddp", "fsdp", "ep"):
        raise ValueError(f"parallelize: `mode` must be 'ddp', 'fsdp' or 'ep', got {mode!r}")
    check_ep(model.config, mode, ep)
    on_meta = model.lm_head.weight.is_meta
    if not on_meta and mode != "ddp":  # (ddp does this itself)
        _broadcast_from_main(model)
    if mode == "fsdp":
        apply_fsdp(model, device, ep)
    elif mode == "ep":
        check_expert_split(model.config, dist.get_world_size())
        shard_experts(model, dist.get_rank(), dist.get_world_size())
    if on_meta:
        materialize(model, device)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # an expert that none of a rank's tokens chose has no gradient there; on a step where every
        # expert was chosen DDP would warn that it found no unused parameter: expected with MoE
        warnings.filterwarnings("ignore", message="find_unused_parameters=True was specified in DDP constructor")
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                       find_unused_parameters=bool(model.moe_layers()))
    return model


RECOMPUTE = ("none", "full", "selective")
SELECTIVE_EVERY = 2  # selective recompute: every 2nd decoder layer, torchtitan's layer option "2"


def apply_recompute(model: CausalLM, mode: str) -> None:
    """Activation recompute (checkpointing) of decoder layers, applied from outside as torchtitan's
    `apply_ac` does, with torch's composable `checkpoint` (forward hooks: parameter names unchanged).

    - **full**: every layer keeps only its inputs (the partial sum and the Block AttnRes sources); the
      backward pass runs its forward again. Activation memory per layer: its input, not its insides.
    - **selective**: the same on every SELECTIVE_EVERY-th layer (2nd, 4th, ...: torchtitan's per-layer
      selective option), the other layers keep everything: about half of full's saving, half its
      extra forward work.
    - **none**: nothing is recomputed.

    An op-level policy (keep the matrix products' outputs, recompute the elementwise work) is not offered:
    k3's chunk kernels update matrix products in place (`U.baddbmm_`, `A.addmm_`), and a kept output
    updated in place is updated twice when the forward runs again (measured: gradients off by 6e-2).
    The recomputed forward is the same arithmetic, so losses and gradients are those of "none" (to
    rounding); the MoE layers' `last_load` is set again to the same counts."""
    if mode not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {mode!r}")
    if mode == "none":
        return
    from torch.distributed._composable import checkpoint

    for i, layer in enumerate(model.model.layers):
        if mode == "full" or (i + 1) % SELECTIVE_EVERY == 0:
            checkpoint(layer)


def materialize(model: CausalLM, device: torch.device) -> None:
    """Allocate a meta-device model's parameters and buffers on `device` (only the shards and experts
    this process holds) and initialise them: the values a one-process model of the same seed has."""
    from ..models.loading import allocate

    allocate(model, device)
    model.reset_parameters()  # buffers too: the routers' correction biases start at zero


def load_expert_parallel(path, device: torch.device) -> CausalLM:
    """`torchrun ... -m k3 generate --parallel ep`: the checkpoint in `path` split over this torchrun job's
    processes, each holding its share of every MoE layer's routed experts and the rest whole, on
    `device`. The model is built on the meta device, split, then filled tensor by tensor from the
    checkpoint, each process reading only the experts it holds (`k3.models.loading.load_held`). In
    every MoE layer the tokens go to the experts' processes and back by all-to-all, once a layer a
    decode step; every process runs the same prompts and computes the same tokens."""
    from ..models.checkpoint import read_config
    from ..models.loading import load_held

    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise ValueError(f"--parallel ep runs under torchrun (missing {', '.join(missing)} in the environment): "
                         f"torchrun --nproc_per_node=N -m k3 generate --parallel ep ...")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    config, _ = read_config(Path(path))
    check_expert_split(config, dist.get_world_size())
    with torch.device("meta"):
        model = CausalLM(config)
    shard_experts(model, dist.get_rank(), dist.get_world_size())
    load_held(model, path)
    return model.to(device)


def check_ep(config, mode: str, ep: int) -> None:
    """`--ep N` goes with `--parallel fsdp`, N dividing both the process count and the experts."""
    if ep == 1:
        return
    world = dist.get_world_size()
    if mode != "fsdp":
        raise ValueError(f"--ep {ep} is for --parallel fsdp (fsdp x expert parallelism); --parallel {mode} "
                         f"takes none (--parallel ep splits the experts over all {world} processes)")
    if world % ep:
        raise ValueError(f"--ep {ep} does not divide the {world} processes: an ep group is {ep} of them; use a "
                         f"process count that {ep} divides, or another --ep")
    if "moe" not in config.mlp_types:
        raise ValueError(f"--ep {ep}: {config.name} has no MoE layer (use --parallel fsdp alone)")
    if config.num_experts % ep:
        raise ValueError(f"--ep {ep} does not divide the {config.num_experts} experts of each MoE layer; use an "
                         f"--ep that divides {config.num_experts}")


def apply_fsdp(model: CausalLM, device: torch.device, ep: int) -> None:
    """fsdp: every decoder layer and the root over all ranks; with ep > 1, the experts first (see
    `parallelize`)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if ep == 1:
        _fully_shard(model, init_device_mesh(device.type, (world,)))
        return
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
    shard_experts(model, mesh["ep"].get_local_rank(), ep, mesh["ep"].get_group())
    for moe in model.moe_layers():
        fully_shard(moe.experts, mesh=mesh["efsdp"])
        moe.experts.set_gradient_divide_factor(world)  # sum over efsdp of ep-group sums, / world
        moe.experts.set_force_sum_reduction_for_comms(True)  # a sum, then the division (gloo has no PreMulSum)
    _fully_shard(model, mesh._flatten("dp"))


def check_expert_split(config, world_size: int) -> None:
    """Expert parallelism needs MoE layers whose experts split evenly over the processes."""
    if "moe" not in config.mlp_types:
        raise ValueError(f"--parallel ep needs a model with MoE layers; {config.name} has none (use ddp or fsdp)")
    if config.num_experts % world_size:
        raise ValueError(f"--parallel ep: the {config.num_experts} experts of each MoE layer do not split evenly "
                         f"over {world_size} processes; use a process count that divides {config.num_experts}")


def held_expert_parameters(model: CausalLM) -> list[nn.Parameter]:
    """The routed experts' parameters this process holds (under ep, its own slice of the experts)."""
    return [p for moe in model.moe_layers() for expert in moe.experts if expert is not None
            for p in expert.parameters()]


def _broadcast_from_main(model: nn.Module) -> None:
    for t in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(t.data, src=0)


def _fully_shard(model: CausalLM, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if model.moe_layers():
        if not hasattr(model, "set_reduce_scatter_unused_params"):
            raise RuntimeError(f"--parallel fsdp with MoE layers needs FSDPModule.set_reduce_scatter_unused_params "
                               f"(torch {torch.__version__} lacks it): an expert none of a rank's tokens chose has "
                               f"no gradient there, and FSDP's reduce-scatter needs the same tensors on every rank")
        model.set_reduce_scatter_unused_params(True)  # zeros; globally unused experts go back to None
    # k3 adds every sub-layer's output out of place, so the in-place hazard this warns of cannot arise
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")


def shard_experts(model: CausalLM, rank: int, world_size: int, group=None) -> None:
    """Keep this rank's slice of every MoE layer's routed experts (the others become None) and hook the
    token exchange around them (on a model on the meta device too: then nothing is allocated). `rank`
    and `world_size` are within `group`, the process group the tokens are exchanged in (None: all)."""
    for moe in model.moe_layers():
        moe.experts.ep_group = group
        per_rank = len(moe.experts) // world_size
        own = range(rank * per_rank, (rank + 1) * per_rank)
        for e in range(len(moe.experts)):
            if e not in own:
                moe.experts[e] = None
        moe.experts.register_forward_pre_hook(_dispatch_tokens)
        moe.experts.register_forward_hook(_combine_outputs)


@dataclass
class _Route:
    """What `_combine_outputs` needs of the dispatch: which token each sent row was, and the counts."""

    tokens: torch.Tensor  # [S] the token of each row sent, grouped by destination rank
    num_tokens: int  # N
    sent: list[int]  # rows sent to each rank
    received: list[int]  # rows received from each rank


def _dispatch_tokens(experts: nn.Module, args: tuple) -> tuple:
    """Before the routed experts: each token goes once to every rank that owns at least one of its k
    chosen experts (an all-to-all with per-rank counts), with its chosen experts and routing weights.
    There the experts run as in one process, skipping the experts held elsewhere (None), and return
    each received token's weighted sum over that rank's experts."""
    z, chosen, weights, _ = args
    group = experts.ep_group
    world = dist.get_world_size(group)
    owner = chosen // (len(experts) // world)  # [N, k] the rank holding each chosen expert
    needs = torch.zeros(world, len(z), dtype=torch.bool, device=z.device)
    needs[owner.T, torch.arange(len(z), device=z.device).expand_as(owner.T)] = True  # [rank, token]
    destination, tokens = needs.nonzero(as_tuple=True)  # grouped by rank
    sent_counts = torch.bincount(destination, minlength=world)
    received_counts = torch.empty_like(sent_counts)
    dist.all_to_all_single(received_counts, sent_counts, group=group)
    sent, received = sent_counts.tolist(), received_counts.tolist()
    rows = _AllToAllRows.apply(z[tokens], sent, received, group)
    row_weights = _AllToAllRows.apply(weights[tokens], sent, received, group)
    row_chosen = chosen.new_empty((sum(received), chosen.shape[1]))
    dist.all_to_all_single(row_chosen, chosen[tokens].contiguous(), received, sent, group=group)
    experts._route = _Route(tokens, len(z), sent, received)
    return rows, row_chosen, row_weights, torch.bincount(row_chosen.flatten(), minlength=len(experts))


def _combine_outputs(experts: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    """After them: each row goes back to its token's rank (the reverse all-to-all), where a token's
    rows (one per rank it visited) are summed in float32, as one process sums its k experts."""
    route: _Route = experts.__dict__.pop("_route")
    y = _AllToAllRows.apply(out, route.received, route.sent, experts.ep_group)
    combined = torch.zeros(route.num_tokens, out.shape[-1], dtype=upcast(out).dtype, device=out.device)
    return cast(combined.index_add_(0, route.tokens, upcast(y)), out.dtype)


class _AllToAllRows(torch.autograd.Function):
    """Rows [sum(sent), ...] -> [sum(received), ...]: the first sent[0] rows go to rank 0, the next
    sent[1] to rank 1, ...; what arrives is stacked in rank order. Backward: the same exchange reversed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sent: list[int], received: list[int], group=None) -> torch.Tensor:
        ctx.sent, ctx.received, ctx.group = sent, received, group
        out = x.new_empty((sum(received), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), received, sent, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((sum(ctx.sent), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.sent, ctx.received, group=ctx.group)
        return out, None, None, None
