"""The sharding simulation: full-size model on the meta device, k3's expert split and FSDP2 applied
on a fake process group of N ranks, and the parameter values one rank holds read from the sharded
module itself. No GPU, no communication: torch's fake backend (`FakeStore`, backend "fake") answers
every collective without doing it, and meta tensors have shapes but no storage.

The layout is `k3.plan.shapes`', built by the code `k3 train --parallel fsdp --ep EP` runs
(`k3.training.parallel.apply_fsdp`): the device mesh [N / EP ("efsdp"), EP ("ep")]; each MoE layer's
routed experts split over "ep" and sharded by FSDP2 over "efsdp"; every decoder layer, then the root,
sharded over all N ranks, which leaves the experts to their own FSDP unit. No step is run.

`python -m k3.plan.simulate PRESET N EP [RANK]` prints one rank's figures (a process holds one rank:
torch allows one default process group per process).
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from ..models import CausalLM, ModelConfig
from ..training.parallel import apply_fsdp


def simulate(config: ModelConfig, world_size: int, ep: int, rank: int = 0) -> dict[str, float]:
    """Parameter values rank `rank` of `world_size` holds after k3's EP + FSDP2 sharding of `config`
    built on the meta device: {"values": ..., "routed expert values": ..., "seconds": ...}. Starts and
    ends the process's default process group (the fake backend)."""
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if world_size % ep or ("moe" in config.mlp_types and config.num_experts % ep):
        raise ValueError(f"simulate: ep ({ep}) must divide the {world_size} ranks and the experts per layer")
    if dist.is_initialized():
        raise RuntimeError("simulate: a default process group exists already; run it in a process of its own")
    start = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with torch.device("meta"):
            model = CausalLM(config)
        apply_fsdp(model, torch.device("cpu"), ep)  # what `k3 train --parallel fsdp --ep N` runs
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
    print(
        f"{config.name}, N = {n}, ep = {ep}, rank {rank}: {sim['values']:,} parameter values on the sharded "
        f"module ({4 * sim['values'] / 1e9:.3f} GB fp32, {2 * sim['values'] / 1e9:.3f} GB bf16; routed experts "
        f"{sim['routed expert values']:,}); planner {planned:,} "
        f"({'equal' if planned == sim['values'] else 'DIFFERENT'}); "
        f"{sim['seconds']:.1f} s"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
