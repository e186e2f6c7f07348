"""Parallelism applied to a CausalLM from outside, as torchtitan does: the model code is written for
one device, and `parallelize(model, mode, device)` wraps or shards it for the processes of a torchrun
job (the default process group), the same CausalLM on every process to begin with.

- **ddp**: every rank holds the whole model; DistributedDataParallel averages the gradients during
  the backward pass.
- **fsdp**: FSDP2 `fully_shard` on every decoder layer, then on the root: each rank stores 1/N of the
  parameters, gradients and AdamW moments and all-gathers a layer's weights just before using them.
- **ep**: expert parallelism. Rank r owns the routed experts [r E/N, (r+1) E/N) of every MoE layer (the
  other entries of `experts` are None) and replicates everything else. In each MoE layer the ranks
  all-gather their routed tokens (latent z, chosen experts, weights), each runs its own experts on
  every token routed to them, and a reduce-scatter sums the N partial outputs and hands each rank
  back its own tokens' rows: an all-reduce of the combined output, each rank keeping its rows. Both
  are forward hooks on the MoE layer's `RoutedExperts`, which the model does not know about.

What the training step does about gradients in each mode is k3.training.distributed's part.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

from ..models import CausalLM


def parallelize(model: CausalLM, mode: str, device: torch.device) -> nn.Module:
    """Split `model` (on `device`) over the processes for `mode` ("ddp", "fsdp" or "ep"); returns the
    module to call in training: the DDP wrapper, or `model` itself, sharded in place."""
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # an expert that none of a rank's tokens chose has no gradient there
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                       find_unused_parameters=bool(model.moe_layers()))
    _broadcast_from_main(model)  # ddp does this itself
    if mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh

        _fully_shard(model, init_device_mesh(device.type, (dist.get_world_size(),)))
    elif mode == "ep":
        check_expert_split(model.config, dist.get_world_size())
        _shard_experts(model, dist.get_rank(), dist.get_world_size())
    else:
        raise ValueError(f"parallelize: `mode` must be 'ddp', 'fsdp' or 'ep', got {mode!r}")
    return model


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


def _shard_experts(model: CausalLM, rank: int, world_size: int) -> None:
    """Keep this rank's slice of every MoE layer's routed experts and hook the collectives around them."""
    for moe in model.moe_layers():
        per_rank = len(moe.experts) // world_size
        own = range(rank * per_rank, (rank + 1) * per_rank)
        for e in range(len(moe.experts)):
            if e not in own:
                moe.experts[e] = None
        moe.experts.register_forward_pre_hook(_gather_tokens)
        moe.experts.register_forward_hook(_combine_outputs)


def _gather_tokens(experts: nn.Module, args: tuple) -> tuple:
    """Before the routed experts: every rank's tokens, in rank order."""
    z, chosen, weights, _ = args
    chosen = _GatherRows.apply(chosen)
    counts = torch.bincount(chosen.flatten(), minlength=len(experts))
    return _GatherRows.apply(z), chosen, _GatherRows.apply(weights), counts


def _combine_outputs(experts: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    """After them: the sum over ranks of each one's experts' outputs, this rank's rows."""
    return _SumScatterRows.apply(out)


class _GatherRows(torch.autograd.Function):
    """[n, ...] on each rank -> [world * n, ...], the ranks' rows in rank order. Backward: the
    gradient of this rank's rows summed over the ranks (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty((dist.get_world_size() * x.shape[0], *x.shape[1:]))
        _all_gather(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(), *grad.shape[1:]))
        _reduce_scatter(out, grad.contiguous())
        return out


class _SumScatterRows(torch.autograd.Function):
    """[world * n, ...] on each rank -> its rows [n, ...] of the sum over ranks (a reduce-scatter).
    Backward: every rank's gradient of its rows, gathered (an all-gather)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty((x.shape[0] // dist.get_world_size(), *x.shape[1:]))
        _reduce_scatter(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        out = grad.new_empty((dist.get_world_size() * grad.shape[0], *grad.shape[1:]))
        _all_gather(out, grad.contiguous())
        return out


# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
