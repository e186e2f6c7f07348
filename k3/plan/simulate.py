"""The sharding simulation: full-size model on the meta device, k3's expert split and FSDP2 applied
on a fake process group of N ranks, and the parameter values one rank holds read from the sharded
module itself. No GPU, no communication: torch's fake backend (`FakeStore`, backend "fake") answers
every collective without doing it, and meta tensors have shapes but no storage.

The layout is `k3.plan.shapes`': the device mesh (fsdp / ep, ep) over the N ranks; each MoE layer's
routed experts split over the "ep" dimension by `k3.training.parallel.shard_experts` (what `k3 train
--parallel ep` runs); the experts a rank keeps sharded by FSDP2 over the other dimension; then
`k3.training.parallel._fully_shard` (what `--parallel fsdp` runs: every decoder layer, then the root)
over all N ranks, which leaves the experts to their own FSDP unit. k3's training runs ep and fsdp one at
a time; this composes the two as torchtitan does, for the count (no step is run).

`python -m k3.plan.simulate PRESET N EP [RANK]` prints one rank's figures (a process holds one rank:
torch allows one default process group per process).
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from ..models import CausalLM, ModelConfig
from ..training.parallel import _fully_shard, shard_experts


def simulate(config: ModelConfig, world_size: int, ep: int, rank: int = 0) -> dict[str, float]:
    """Parameter values rank `rank` of `world_size` holds after k3's EP + FSDP2 sharding of `config`
    built on the meta device: {"values": ..., "routed expert values": ..., "seconds": ...}. Starts and
    ends the process's default process group (the fake backend)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if world_size % ep or ("moe" in config.mlp_types and config.num_experts % ep):
        raise ValueError(f"simulate: ep ({ep}) must divide the {world_size} ranks and the experts per layer")
    if dist.is_initialized():
        raise RuntimeError("simulate: a default process group exists already; run it in a process of its own")
    start = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size // ep, ep), mesh_dim_names=("fsdp_mod_ep", "ep"))
        with torch.device("meta"):
            model = CausalLM(config)
        if model.moe_layers():
            shard_experts(model, mesh["ep"].get_local_rank(), ep)
            for moe in model.moe_layers():
                fully_shard(moe.experts, mesh=mesh["fsdp_mod_ep"])
        _fully_shard(model, mesh._flatten("fsdp"))
        values = experts = 0
        for name, p in model.named_parameters():
            n = (p.to_local() if isinstance(p, DTensor) else p).numel()
            values += n
            experts += n if ".experts." in name else 0
    finally:
        dist.destroy_process_group()
    return {"values": values, "routed expert values": experts, "seconds": time.perf_counter() - start}


def main(argv: list[str]) -> None:
    from ..models import get_config
    from .shapes import Layout, model_shapes, rank_values

    if len(argv) not in (3, 4):
        raise SystemExit("usage: python -m k3.plan.simulate PRESET N EP [RANK]")
    config, n, ep = get_config(argv[0]), int(argv[1]), int(argv[2])
    rank = int(argv[3]) if len(argv) == 4 else 0
    sim = simulate(config, n, ep, rank)
    planned = sum(rank_values(model_shapes(config), Layout(n, 1, n, ep), rank).values())
    print(f"{config.name}, N = {n}, ep = {ep}, rank {rank}: {sim['values']:,} parameter values on the sharded "
          f"module ({4 * sim['values'] / 1e9:.3f} GB fp32, {2 * sim['values'] / 1e9:.3f} GB bf16; routed experts "
          f"{sim['routed expert values']:,}); planner {planned:,} ({'equal' if planned == sim['values'] else 'DIFFERENT'}); "
          f"{sim['seconds']:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
