"""Parallelism applied to a CausalLM from outside, as torchtitan does: the model code is written for
one device, and `parallelize(model, dims)` wraps or shards it for the processes of a torchrun job (the
default process group), the same CausalLM on every process to begin with. This is the one module that
knows about ranks: `init_parallel` reads torchrun's environment, starts the process group and builds
the `ParallelDims` (sizes, this rank, the DeviceMesh) that the training step asks for its reductions.

- **ddp**: every rank holds the whole model; DistributedDataParallel averages the gradients during
  the backward pass.
- **fsdp**: FSDP2 `fully_shard` on every decoder layer, then on the root: each rank stores 1/N of the
  parameters, gradients and AdamW moments and all-gathers a layer's weights just before using them.
- **fsdp x ep** (`--ep N`): the routed experts split over groups of N ranks as well (`apply_fsdp`).
  In each MoE layer a token is sent once to each rank of its group that owns one of its chosen experts
  and nowhere else (an all-to-all with per-rank counts, the dispatch of DeepSeek-V3, torchtitan and
  Megatron), that rank returns the token's weighted sum over its own chosen experts, and a second
  all-to-all brings those rows home, where they are summed. A token travels to at most min(k, R) - 1
  other ranks (R ranks, top-k), so the traffic per rank is bounded by k whatever R; an all-gather of
  every token grows with R. Both exchanges are forward hooks on the MoE layer's `RoutedExperts`,
  which the model does not know about; backward runs them in reverse.
- **ep** (`--parallel ep`): fsdp x ep with the experts split over all ranks and an fsdp size of 1 for
  the dense parameters: FSDP2 over a [world ("replicate"), 1 ("shard")] mesh, so every rank holds
  them whole and their gradients are averaged by FSDP's all-reduce, as DDP's would be.
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

MODES = ("none", "ddp", "fsdp", "ep")
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class ParallelDims:
    """How a run is spread over processes (torchtitan's ParallelDims): the sizes, this process's rank,
    its device and the DeviceMesh, and the reductions over processes that the training step and the
    evaluation need. `ParallelDims()` is one process: world 1, every reduction the identity.

    `mode`: "none", "ddp" or "fsdp" (`--parallel ep` is fsdp, see the module); `ep`: the routed experts
    split over groups of `ep` ranks (1: every rank holds them all); `shard_dense`: fsdp shards the dense
    parameters over all ranks (False: each holds them whole); `mesh`: fsdp's [world / ep ("efsdp"),
    ep ("ep")] mesh, or [world ("dp")] with ep 1 (None: one process, or ddp)."""

    mode: str = "none"
    world: int = 1
    rank: int = 0
    ep: int = 1
    shard_dense: bool = True
    device: torch.device = torch.device("cpu")
    mesh: object = None  # a torch.distributed DeviceMesh

    @property
    def experts_split(self) -> bool:
        """Each rank holds only some of the routed experts."""
        return self.ep > 1

    @property
    def expert_group(self):
        """The process group the experts are split over (None: not split)."""
        return self.mesh["ep"].get_group() if self.experts_split else None

    def describe(self) -> str:
        """The layout in words, for the opening message."""
        if self.mode == "fsdp" and not self.shard_dense:
            return f"ep: fsdp x ep {self.ep}, the dense part whole in each"
        return f"fsdp x ep {self.ep}" if self.experts_split else self.mode

    def local_batch(self, windows: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous, equal share of a global batch [B, T + 1], on its device."""
        b = windows.shape[0] // self.world
        return windows[self.rank * b : (self.rank + 1) * b].to(self.device)

    def local_windows(self, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The validation windows this rank runs, and which of them count (None: all): an equal share
        for each rank, the last padded with repeats that are not counted (fsdp needs the same calls on
        every rank)."""
        if self.world == 1:
            return windows, None
        n = windows.shape[0]
        per_rank = -(-n // self.world)
        index = torch.arange(self.rank * per_rank, (self.rank + 1) * per_rank)
        return windows[index.clamp(max=n - 1)], index < n

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """`values` summed over all ranks (one all-reduce)."""
        if self.world > 1:
            values = values.to(self.device)
            dist.all_reduce(values)
        return values

    def max(self, values: torch.Tensor) -> torch.Tensor:
        """`values` maximised over all ranks (a MAX all-reduce), so that every rank decides alike."""
        if self.world > 1:
            values = values.to(self.device)
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        return values


def init_parallel(mode: str, device: str = "auto", ep: int = 1) -> tuple[ParallelDims, bool]:
    """This torchrun process's ParallelDims for `mode` ("ddp", "fsdp", or "ep": fsdp with the experts
    split over all ranks and the dense parameters whole), read from torchrun's environment, its process
    group started (gloo on CPUs, NCCL with one GPU a process) unless the caller has one. Returns the dims
    and whether this call started the group (then the caller ends it)."""
    from ..runtime import resolve_device

    if device == "mps":
        raise ValueError(
            f"--device mps: --parallel {mode} runs its processes on CUDA GPUs (NCCL) or CPUs (gloo); "
            "MPS has no multi-process backend. Use --device cpu, or one process"
        )
    resolve_device("cpu" if device == "auto" else device)  # (checks that a named device exists)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device != "cpu" and torch.cuda.is_available():
        where, backend = torch.device("cuda", int(os.environ["LOCAL_RANK"])), "nccl"
        torch.cuda.set_device(where)
    else:
        where, backend = torch.device("cpu"), "gloo"
    started = not dist.is_initialized()  # a caller's process group is left to the caller
    if started:
        dist.init_process_group(backend)
    shard_dense = mode != "ep"
    if mode == "ep":
        mode, ep = "fsdp", world
    mesh = fsdp_mesh(where, world, ep) if mode == "fsdp" else None
    return ParallelDims(mode, world, rank, ep, shard_dense, where, mesh), started


def fsdp_mesh(device: torch.device, world: int, ep: int):
    """fsdp's DeviceMesh: [world ("dp")], or with ep > 1 [world / ep ("efsdp"), ep ("ep")]."""
    from torch.distributed.device_mesh import init_device_mesh

    if ep == 1:
        return init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    return init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("efsdp", "ep"))


def parallelize(model: CausalLM, dims: ParallelDims, precision: str = "fp32") -> nn.Module:
    """Split `model` (on `dims.device`) over the processes as `dims` says; returns the module to call in
    training: the DDP wrapper, or `model` itself, sharded in place.

    A model on the meta device (built there: no process holds it whole) is split first and then
    materialised, each process allocating and initialising only what it holds (`CausalLM.reset_parameters`
    draws each parameter's values from its name, so every shard gets the one-process values); a model
    with weights (a resumed run's) is made the same on every process from rank 0's. `precision` (`k3 train
    --precision`): under bf16 fsdp gathers bfloat16 weights (`mixed_precision`)."""
    if dims.mode not in ("ddp", "fsdp"):
        raise ValueError(f"parallelize: `dims.mode` must be 'ddp' or 'fsdp', got {dims.mode!r}")
    if dims.shard_dense:
        check_ep(model.config, dims.mode, dims.ep)
    else:
        check_expert_split(model.config, dims.world)
    on_meta = model.lm_head.weight.is_meta
    if not on_meta and dims.mode != "ddp":  # (ddp does this itself)
        _broadcast_from_main(model)
    if dims.mode == "fsdp":
        apply_fsdp(model, dims.device, dims.ep, shard_dense=dims.shard_dense, mesh=dims.mesh, precision=precision)
    if on_meta:
        materialize(model, dims.device)
    if dims.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # an expert that none of a rank's tokens chose has no gradient there; on a step where every
        # expert was chosen DDP would warn that it found no unused parameter: expected with MoE
        warnings.filterwarnings("ignore", message="find_unused_parameters=True was specified in DDP constructor")
        return DistributedDataParallel(
            model,
            device_ids=[dims.device.index] if dims.device.type == "cuda" else None,
            find_unused_parameters=bool(model.moe_layers()),
        )
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
    from ..checkpoints.loading import allocate

    allocate(model, device)
    model.reset_parameters()  # buffers too: the routers' correction biases start at zero


def load_expert_parallel(path, device: torch.device) -> CausalLM:
    """`torchrun ... -m k3 generate --parallel ep`: the checkpoint in `path` split over this torchrun job's
    processes, each holding its share of every MoE layer's routed experts and the rest whole, on
    `device`. The model is built on the meta device, split, then filled tensor by tensor from the
    checkpoint, each process reading only the experts it holds (`k3.checkpoints.loading.load_held`). In
    every MoE layer the tokens go to the experts' processes and back by all-to-all, once a layer a
    decode step; every process runs the same prompts and computes the same tokens."""
    from ..checkpoints.checkpoint import read_config
    from ..checkpoints.loading import load_held

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


def check_ep(config, mode: str, ep: int) -> None:
    """`--ep N` goes with `--parallel fsdp`, N dividing both the process count and the experts."""
    if ep == 1:
        return
    world = dist.get_world_size()
    if mode != "fsdp":
        raise ValueError(
            f"--ep {ep} is for --parallel fsdp (fsdp x expert parallelism); --parallel {mode} "
            f"takes none (--parallel ep splits the experts over all {world} processes)"
        )
    if world % ep:
        raise ValueError(
            f"--ep {ep} does not divide the {world} processes: an ep group is {ep} of them; use a "
            f"process count that {ep} divides, or another --ep"
        )
    if "moe" not in config.mlp_types:
        raise ValueError(f"--ep {ep}: {config.name} has no MoE layer (use --parallel fsdp alone)")
    if config.num_experts % ep:
        raise ValueError(
            f"--ep {ep} does not divide the {config.num_experts} experts of each MoE layer; use an "
            f"--ep that divides {config.num_experts}"
        )


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
    """fsdp: every decoder layer and the root over all ranks (`mesh`: the [world] one, built here when
    None). With ep > 1 (`--parallel fsdp --ep N`, torchtitan's composition), first the experts: one
    DeviceMesh [world/N ("efsdp"), N ("ep")]; every MoE layer's routed experts are split over the N ranks
    of an ep group (the tokens exchanged by all-to-all within it) and each expert is sharded over the
    world/N ranks that hold it (a nested `fully_shard(moe.experts, mesh=efsdp)`). An expert's gradient on
    its ranks sums the tokens of its ep group; the reduce-scatter over efsdp sums the groups, divided by
    the world size: the mean gradient, as the dense parameters' is. The dense parameters are sharded
    over all ranks (the mesh flattened), or with `shard_dense` False held whole by every rank (a
    [world, 1] mesh: FSDP2's replicated, HSDP, layout; the gradients all-reduced). `precision` "bf16":
    every unit gathers bfloat16 weights (`mixed_precision`)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    policy = mixed_precision(precision)
    if ep == 1 and shard_dense:
        _fully_shard(model, mesh if mesh is not None else init_device_mesh(device.type, (world,)), policy)
        return
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
    if ep > 1:
        shard_experts(model, mesh["ep"].get_local_rank(), ep, mesh["ep"].get_group())
        for moe in model.moe_layers():
            fully_shard(moe.experts, mesh=mesh["efsdp"], mp_policy=policy)
            moe.experts.set_gradient_divide_factor(world)  # sum over efsdp of ep-group sums, / world
            if world // ep > 1:  # a sum, then the division (gloo has no PreMulSum); over one rank FSDP2
                # sends nothing and divides once in its copy, and forcing the sum would divide again
                moe.experts.set_force_sum_reduction_for_comms(True)
            else:
                _undo_double_division(moe.experts, world, policy)
    if shard_dense:
        _fully_shard(model, mesh._flatten("dp"), policy)
    else:
        _fully_shard(model, init_device_mesh(device.type, (world, 1), mesh_dim_names=("replicate", "shard")), policy)


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


def check_expert_split(config, world_size: int) -> None:
    """Expert parallelism needs MoE layers whose experts split evenly over the processes."""
    if "moe" not in config.mlp_types:
        raise ValueError(f"--parallel ep needs a model with MoE layers; {config.name} has none (use ddp or fsdp)")
    if config.num_experts % world_size:
        raise ValueError(
            f"--parallel ep: the {config.num_experts} experts of each MoE layer do not split evenly "
            f"over {world_size} processes; use a process count that divides {config.num_experts}"
        )


def held_expert_parameters(model: CausalLM) -> list[nn.Parameter]:
    """The routed experts' parameters this process holds (under ep, its own slice of the experts)."""
    return [
        p for moe in model.moe_layers() for expert in moe.experts if expert is not None for p in expert.parameters()
    ]


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
    z, chosen, weights = args
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
    return rows, row_chosen, row_weights


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
