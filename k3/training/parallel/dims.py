"""How a run is spread over processes (torchtitan's ParallelDims): the sizes, this process's rank, its
device and DeviceMesh, the reductions the training step and the evaluation need, and the agreements
the loop and the checkpointer need (share, gather, any, on_main). This is the one module that reads
torchrun's environment (`parallel_dims`) and starts the process group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

MODES = ("none", "ddp", "fsdp", "ep")
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class Launch(NamedTuple):
    """This process in its launch, as torchrun's environment says it (RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE: the processes on this machine); rank 0 of 1 without torchrun."""

    rank: int = 0
    world: int = 1
    local_world: int = 1
    under_torchrun: bool = False  # RANK and WORLD_SIZE are set


def launch() -> Launch:
    """torchrun's environment, read (every reader of it in k3.training asks here)."""
    env = os.environ
    world = int(env.get("WORLD_SIZE", "1"))
    return Launch(
        int(env.get("RANK", "0")), world, int(env.get("LOCAL_WORLD_SIZE", world)), "RANK" in env and "WORLD_SIZE" in env
    )


@dataclass(frozen=True)
class ParallelDims:
    """How a run is spread over processes (torchtitan's ParallelDims): the sizes, this process's rank,
    its device and the DeviceMesh, and the reductions over processes that the training step and the
    evaluation need. `ParallelDims()` is one process: world 1, every reduction the identity.

    `mode`: "none", "ddp" or "fsdp" (`--parallel ep` is fsdp with the experts split over all ranks and the
    dense parameters whole); `ep`: the routed experts split over groups of `ep` ranks (1: every rank
    holds them all); `shard_dense`: the dense parameters sharded over all ranks (False: each holds them
    whole, FSDP2-replicated: ddp, ep); `mesh`: fsdp's [world / ep ("efsdp"), ep ("ep")] mesh, or [world
    ("dp")] with ep 1 (None: one process, or ddp, whose [world, 1] mesh `parallelize` makes)."""

    mode: str = "none"
    world: int = 1
    rank: int = 0
    ep: int = 1
    shard_dense: bool = True
    device: torch.device = torch.device("cpu")
    mesh: object = None  # a torch.distributed DeviceMesh
    owns_group: bool = False  # this process started the process group (`close` ends it)

    @property
    def is_main(self) -> bool:
        """The process that logs and writes (rank 0)."""
        return self.rank == 0

    @property
    def experts_split(self) -> bool:
        """Each rank holds only some of the routed experts."""
        return self.ep > 1

    @property
    def expert_group(self):
        """The process group the experts are split over (None: not split)."""
        return self.mesh["ep"].get_group() if self.experts_split else None

    def describe(self) -> str:
        """The layout in words, for the opening message ("" on one process)."""
        if self.world == 1:
            return ""
        return f" in each of {self.world} processes ({self.layout()})"

    def layout(self) -> str:
        """The mode in words."""
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

    # -- agreement: on one process each is the identity ------------------------------------------------
    def on_main(self, work):
        """`work()` on rank 0 (the others pass None); its error, if any, raised on every rank, so that no
        rank waits forever for one that has given up."""
        if self.world == 1:
            return work()
        result, error = None, None
        if self.is_main:
            try:
                result = work()
            except Exception as e:
                error = e
        error = self.share(error)
        if error is not None:
            raise error
        return result

    def share(self, value):
        """Rank 0's `value` on every rank (a decision only one clock should make)."""
        if self.world == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, value) -> list | None:
        """Every rank's `value`, in rank order, on rank 0 (None elsewhere)."""
        if self.world == 1:
            return [value]
        parts = [None] * self.world if self.is_main else None
        dist.gather_object(value, parts, dst=0)
        return parts

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on some rank."""
        if self.world == 1:
            return flag
        t = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def close(self) -> None:
        """End the process group if this process started it."""
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def parallel_dims(mode: str, batch_size: int, device: str = "auto", ep: int = 1) -> ParallelDims:
    """The `ParallelDims` of this process for `k3 train --parallel mode` (the one place torchrun's
    environment is read): "none" is one process on `device` ("auto": CUDA, then MPS, then the CPU), the
    other modes run under torchrun, whose process group this starts. The global batch (a micro-batch of
    it, with gradient accumulation) must split evenly over the processes."""
    from ...runtime import exit_with_launcher, resolve_device

    if mode not in MODES:
        raise ValueError(f"--parallel must be one of {', '.join(MODES)}, got {mode!r}")
    world = launch().world
    if ep != 1 and mode != "fsdp":
        raise ValueError(f"--ep {ep} is for --parallel fsdp (fsdp x expert parallelism), not --parallel {mode}")
    if mode == "none":
        if world > 1:
            raise ValueError(
                f"--parallel none, but torchrun started {world} processes (WORLD_SIZE={world}): each "
                f"would train the same model and write the same checkpoint; use --parallel ddp, fsdp or ep"
            )
        return ParallelDims(device=resolve_device(device))
    missing = [name for name in TORCHRUN_ENV if name not in os.environ]
    if missing:
        raise ValueError(
            f"--parallel {mode} runs under torchrun (missing {', '.join(missing)} in the environment): "
            f"torchrun --nproc_per_node=N -m k3 train ... --parallel {mode}"
        )
    if batch_size % world:
        raise ValueError(
            f"--batch-size must be a multiple of the {world} processes (each takes an equal share of "
            f"the global batch), got {batch_size}"
        )
    exit_with_launcher()  # a torchrun worker ends with its launcher, not training on as an orphan
    return init_parallel(mode, device, ep)


def init_parallel(mode: str, device: str = "auto", ep: int = 1) -> ParallelDims:
    """This torchrun process's ParallelDims for `mode` ("ddp": the model whole in every process; "fsdp";
    "ep": fsdp with the experts split over all ranks and the dense parameters whole), read from
    torchrun's environment, its process group started (gloo on CPUs, NCCL with one GPU a process)
    unless the caller has one (`owns_group`: whether this call started it)."""
    from ...runtime import resolve_device

    if device == "mps":
        raise ValueError(
            f"--device mps: --parallel {mode} runs its processes on CUDA GPUs (NCCL) or CPUs (gloo); "
            "MPS has no multi-process backend. Use --device cpu, or one process"
        )
    resolve_device("cpu" if device == "auto" else device)  # (checks that a named device exists)
    rank, world = launch()[:2]
    if device != "cpu" and torch.cuda.is_available():
        where, backend = torch.device("cuda", int(os.environ["LOCAL_RANK"])), "nccl"
        torch.cuda.set_device(where)
    else:
        where, backend = torch.device("cpu"), "gloo"
    started = not dist.is_initialized()  # a caller's process group is left to the caller
    if started:
        dist.init_process_group(backend)
    shard_dense = mode not in ("ep", "ddp")
    if mode == "ep":
        mode, ep = "fsdp", world
    mesh = fsdp_mesh(where, world, ep) if mode == "fsdp" else None
    return ParallelDims(mode, world, rank, ep, shard_dense, where, mesh, started)


def fsdp_mesh(device: torch.device, world: int, ep: int):
    """fsdp's DeviceMesh: [world ("dp")], or with ep > 1 [world / ep ("efsdp"), ep ("ep")]."""
    from torch.distributed.device_mesh import init_device_mesh

    if ep == 1:
        return init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    return init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("efsdp", "ep"))


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


def check_expert_split(config, world_size: int) -> None:
    """Expert parallelism needs MoE layers whose experts split evenly over the processes."""
    if "moe" not in config.mlp_types:
        raise ValueError(f"--parallel ep needs a model with MoE layers; {config.name} has none (use ddp or fsdp)")
    if config.num_experts % world_size:
        raise ValueError(
            f"--parallel ep: the {config.num_experts} experts of each MoE layer do not split evenly "
            f"over {world_size} processes; use a process count that divides {config.num_experts}"
        )
