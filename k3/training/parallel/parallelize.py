"""Parallelism applied to a CausalLM from outside, as torchtitan does: the model code is written for
one device, and `parallelize(model, dims)` shards it in place for the processes of a torchrun job, the
same CausalLM on every process to begin with. Every mode is FSDP2 over a DeviceMesh (`ParallelDims`,
k3.training.parallel.dims), so the gradients, their clipping and the training state go one way:

- **ddp**: FSDP2 over a [world ("replicate"), 1 ("shard")] mesh (HSDP with shards of one): every rank
  holds the whole model and FSDP's all-reduce averages the gradients, as DistributedDataParallel's
  would; the parameters are replicated DTensors.
- **fsdp**: FSDP2 `fully_shard` on every decoder layer, then on the root: each rank stores 1/N of the
  parameters, gradients and AdamW moments and all-gathers a layer's weights just before using them.
- **fsdp x ep** (`--ep N`): the routed experts split over groups of N ranks as well (`apply_fsdp`; the
  token exchange is k3.training.parallel.expert_parallel's).
- **ep** (`--parallel ep`): fsdp x ep with the experts split over all ranks and the dense parameters
  whole in every rank, replicated as under ddp.

Activation recompute (`apply_recompute`) and torch.compile (`compile_decoder`) are applied the same way.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ...models import CausalLM
from ...runtime import cxx_compiler
from .dims import ParallelDims, check_ep, check_expert_split
from .expert_parallel import shard_experts


def parallelize(model: CausalLM, dims: ParallelDims, precision: str = "fp32") -> nn.Module:
    """Split `model` (on `dims.device`) over the processes as `dims` says, in place; returns it.

    A model on the meta device (built there: no process holds it whole) is split first and then
    materialised, each process allocating and initialising only what it holds (`CausalLM.reset_parameters`
    draws each parameter's values from its name, so every shard gets the one-process values); a model
    with weights (a resumed run's) is made the same on every process from rank 0's. `precision` (`k3 train
    --precision`): under bf16 every unit gathers bfloat16 weights (`mixed_precision`)."""
    if dims.mode not in ("ddp", "fsdp"):
        raise ValueError(f"parallelize: `dims.mode` must be 'ddp' or 'fsdp', got {dims.mode!r}")
    if dims.mode == "fsdp" and not dims.shard_dense:  # --parallel ep
        check_expert_split(model.config, dims.world)
    else:
        check_ep(model.config, dims.mode, dims.ep)
    on_meta = model.lm_head.weight.is_meta
    if not on_meta:
        _broadcast_from_main(model)
    apply_fsdp(model, dims.device, dims.ep, shard_dense=dims.shard_dense, mesh=dims.mesh, precision=precision)
    if on_meta:
        materialize(model, dims.device)
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
    from ...checkpoints.loading import allocate

    allocate(model, device)
    model.reset_parameters()  # buffers too: the routers' correction biases start at zero


def mixed_precision(precision: str):
    """FSDP2's MixedPrecisionPolicy for `--precision`: under bf16, torchtitan's (the weights gathered and
    computed with in bfloat16 from float32 shards, the gradients reduced in float32, inputs left as they
    are: half the gather traffic of float32, the same reductions); under fp32 FSDP's default."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision != "bf16":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)


def apply_fsdp(
    model: CausalLM, device: torch.device, ep: int, shard_dense: bool = True, mesh=None, precision: str = "fp32"
) -> None:
    """FSDP2: every decoder layer and the root over all ranks (`mesh`: the [world] one, built here when
    None). With ep > 1 (`--parallel fsdp --ep N`, torchtitan's composition), first the experts: one
    DeviceMesh [world/N ("efsdp"), N ("ep")]; every MoE layer's routed experts are split over the N ranks
    of an ep group (the tokens exchanged by all-to-all within it) and each expert is sharded over the
    world/N ranks that hold it (a nested `fully_shard(moe.experts, mesh=efsdp)`). An expert's gradient on
    its ranks sums the tokens of its ep group; the reduce-scatter over efsdp sums the groups, divided by
    the world size: the mean gradient, as the dense parameters' is. The dense parameters are sharded
    over all ranks (the mesh flattened), or with `shard_dense` False held whole by every rank (a
    [world, 1] mesh: FSDP2's replicated, HSDP, layout; the gradients all-reduced: ddp, and ep's dense
    part). `precision` "bf16": every unit gathers bfloat16 weights (`mixed_precision`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    policy = mixed_precision(precision)
    if ep > 1:
        mesh = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
        shard_experts(model, mesh["ep"].get_local_rank(), ep, mesh["ep"].get_group())
        for moe in model.moe_layers():
            fully_shard(moe.experts, mesh=mesh["efsdp"], mp_policy=policy)
            moe.experts.set_gradient_divide_factor(world)  # sum over efsdp of ep-group sums, / world
            if world // ep > 1:  # a sum, then the division (gloo has no PreMulSum); over one rank FSDP2
                # sends nothing and divides once in its copy, and forcing the sum would divide again
                moe.experts.set_force_sum_reduction_for_comms(True)
            else:
                _undo_double_division(moe.experts, world, policy)
    if not shard_dense:
        mesh = init_device_mesh(device.type, (world, 1), mesh_dim_names=("replicate", "shard"))
    elif ep > 1:
        mesh = mesh._flatten("dp")
    elif mesh is None:
        mesh = init_device_mesh(device.type, (world,))
    _fully_shard(model, mesh, policy)


def _undo_double_division(experts: nn.Module, factor: int, policy) -> None:
    """Over one rank FSDP2 (torch 2.13) divides a float64 / float16 gradient by its pre-divide factor and
    then by the whole factor: its all-reduce hook, run in between, multiplies the first division back."""
    reduced = policy.reduce_dtype or policy.param_dtype or next(experts.parameters()).dtype
    if reduced in (torch.float32, torch.bfloat16):
        return
    pre = 1
    while factor % pre == 0 and factor / pre > pre:  # FSDP2's own split of the factor
        pre *= 2
    experts.set_all_reduce_hook(lambda reduced: reduced.mul_(pre))


def _broadcast_from_main(model: nn.Module) -> None:
    for t in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(t.data, src=0)


def _fully_shard(model: CausalLM, mesh, policy) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if model.moe_layers():
        if not hasattr(model, "set_reduce_scatter_unused_params"):
            raise RuntimeError(
                f"--parallel fsdp with MoE layers needs FSDPModule.set_reduce_scatter_unused_params "
                f"(torch {torch.__version__} lacks it): an expert none of a rank's tokens chose has "
                f"no gradient there, and FSDP's reduce-scatter needs the same tensors on every rank"
            )
        model.set_reduce_scatter_unused_params(True)  # zeros; globally unused experts go back to None
    # k3 adds every sub-layer's output out of place, so the in-place hazard this warns of cannot arise
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")


def compile_decoder(model: CausalLM, fullgraph: bool = False) -> None:
    """`k3 train --compile`: torch.compile the decoder in place (`nn.Module.compile`: parameter names and
    checkpoints unchanged), so that its elementwise work (SiTU, norms, gates) runs as fused kernels.
    `fullgraph`: as one graph, which the decoder is on one process (the parallel modes' hooks around
    it run collectives); evaluations run it eager (`k3.training.objective.summed_loss`), so their other
    batch shapes cost no compile.

    The first step compiles for minutes, so it pays on long runs and is off by default (its speed:
    docs/training.md). On a CPU, inductor builds C++ kernels: without a C++ compiler it cannot run, and
    this says so before any work is done."""
    if model.lm_head.weight.device.type == "cpu" and cxx_compiler() is None:
        raise ValueError(
            "--compile: torch.compile builds C++ kernels for the CPU and no C++ compiler was found "
            "(looked for $CXX, g++, c++, clang++); install one (e.g. apt install g++) or train without "
            "--compile"
        )
    model.model.compile(fullgraph=fullgraph)


def load_expert_parallel(path, device: torch.device) -> CausalLM:
    """`torchrun ... -m k3 generate --parallel ep`: the checkpoint in `path` split over this torchrun job's
    processes, each holding its share of every MoE layer's routed experts and the rest whole, on
    `device`. The model is built on the meta device, split, then filled tensor by tensor from the
    checkpoint, each process reading only the experts it holds (`k3.checkpoints.loading.load_held`). In
    every MoE layer the tokens go to the experts' processes and back by all-to-all, once a layer a
    decode step; every process runs the same prompts and computes the same tokens."""
    from ...checkpoints.checkpoint import read_config
    from ...checkpoints.loading import load_held

    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise ValueError(
            f"--parallel ep runs under torchrun (missing {', '.join(missing)} in the environment): "
            f"torchrun --nproc_per_node=N -m k3 generate --parallel ep ..."
        )
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    config, _ = read_config(Path(path), CausalLM.config_class)
    check_expert_split(config, dist.get_world_size())
    with torch.device("meta"):
        model = CausalLM(config)
    shard_experts(model, dist.get_rank(), dist.get_world_size())
    load_held(model, path)
    return model.to(device)
