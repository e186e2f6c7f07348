"""Distributed Muon (`k3.training.dist_muon`): under `--parallel fsdp` each sharded matrix is orthogonalised
by one owner rank, and the steps equal one-process Muon's (float64, 1e-10) on 2 and 4 gloo processes, with
and without ep 2 — QK-Clip and the AdamW parameters included — while each rank runs about 1 / world of the
Newton-Schulz work and sends at most 2 / world of what gathering every matrix whole sent."""

from __future__ import annotations

import os

import pytest
import torch

from k3.training.dist_muon import exchange_plan, muon_exchange_bytes, owners, row_split

from ..processes import free_port, join, leave

SMALL = {"hidden_size": 32, "num_layers": 3, "num_experts": 8, "num_experts_per_tok": 2}  # KDA, MoE, MLA + AttnRes
STEPS = 3


def test_row_split_is_torch_chunks():
    for rows, ranks in [(10, 4), (7, 2), (3, 4), (1, 3), (16, 4), (0, 2)]:
        want = [len(c) for c in torch.arange(rows).chunk(ranks)] if rows else []
        assert row_split(rows, ranks) == want + [0] * (ranks - len(want))


def test_owners_balance_the_matrices_sizes():
    shapes = [(64, 32)] * 6 + [(128, 64)] * 2 + [(32, 8)] * 5 + [(32, 64)] * 3
    owner = owners(shapes, 4)
    load = [sum(a * b for (a, b), o in zip(shapes, owner) if o == r) for r in range(4)]
    # within a quarter of an even split, or the largest matrix alone (which no split divides)
    assert max(load) <= max(1.25 * sum(load) / 4, max(a * b for a, b in shapes))
    assert sorted(load)[0] > 0  # every rank owns some
    again = owners(list(reversed(shapes)), 4)
    assert sorted(sum(a * b for (a, b), o in zip(reversed(shapes), again) if o == r) for r in range(4)) == sorted(load)
    assert owner == owners(shapes, 4)  # every rank computes the same


def test_the_two_exchanges_mirror_each_other():
    """What rank r sends to the owners equals what each owner expects from r, and the plan's bytes are at
    most 2 / world of the whole-matrix all-gather's (M - 1) / M of every matrix."""
    shapes = [(48, 32)] * 8 + [(33, 17)] * 6 + [(64, 64)] * 4 + [(7, 3)] * 5 + [(5, 64)] * 3
    for world in (2, 3, 4, 8):
        plans = [exchange_plan(shapes, world, r) for r in range(world)]
        for r in range(world):
            for o in range(world):
                assert plans[r].to_owners()[0][o] == plans[o].to_owners()[1][r]
        gathered = (world - 1) * sum(-(-a // world) * b for a, b in shapes) * 4
        assert muon_exchange_bytes(shapes, world) <= 2 / world * gathered * 1.05  # (a rank's share, unevened)


def _worker(rank: int, world: int, port: int, ep: int, out: str) -> None:
    join(rank, world, port)
    from k3.models import get_config
    from k3.training import Checkpointer, TrainConfig, build, build_model, train_step
    from k3.training.parallel import init_parallel

    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    cfg = TrainConfig(batch_size=8, seq_len=16, ep=ep, lr=2e-2, qk_clip=1e-3)
    dims = init_parallel("fsdp", "cpu", ep)
    model = build_model(get_config("kimi-k3-tiny", vocab_size=257, **SMALL), dims)
    optimizer, groups = build(model, cfg, dims)
    generator = torch.Generator().manual_seed(0)
    flops = []
    for _ in range(STEPS):
        train_step(model, optimizer, torch.randint(0, 257, (8, 17), generator=generator), cfg, dims)
        flops.append(optimizer.ns_flops)
    weights, _ = Checkpointer(model, optimizer, dims, groups).full_state()
    parts = [None] * world
    torch.distributed.all_gather_object(parts, flops[-1])
    if rank == 0:
        torch.save({"weights": weights, "ns_flops": parts}, out)
    leave()


def _single() -> tuple[dict, int]:
    from k3.models import CausalLM, get_config
    from k3.training import ParallelDims, TrainConfig, build, train_step

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        cfg = TrainConfig(batch_size=8, seq_len=16, lr=2e-2, qk_clip=1e-3)
        dims = ParallelDims()
        model = CausalLM(get_config("kimi-k3-tiny", vocab_size=257, **SMALL))
        optimizer, _ = build(model, cfg, dims)
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        generator = torch.Generator().manual_seed(0)
        clipped = 0
        for _ in range(STEPS):
            result = train_step(model, optimizer, torch.randint(0, 257, (8, 17), generator=generator), cfg, dims)
            clipped += result.qk_clipped_heads
        assert clipped > 0  # QK-Clip rescaled heads in these steps: its path is compared too
        weights = {n: t.detach().clone() for n, t in model.state_dict().items()}  # the routers' biases too
        unchanged = [
            n
            for n, p in model.named_parameters()
            if p.dim() == 2 and p.grad is not None and p.grad.any() and torch.equal(weights[n], start[n])
        ]
        assert not unchanged, unchanged
        return weights, optimizer.ns_flops
    finally:
        torch.set_default_dtype(default)


@pytest.mark.slow
@pytest.mark.parametrize("world, ep", [(2, 1), (2, 2), (4, 1), (4, 2)])
def test_distributed_muon_takes_the_single_process_steps(tmp_path, world, ep):
    out = os.path.join(tmp_path, "result.pt")
    torch.multiprocessing.spawn(_worker, args=(world, free_port(), ep, out), nprocs=world)
    got = torch.load(out, weights_only=False)
    want, single_flops = _single()
    assert set(got["weights"]) == set(want)
    for name, w in want.items():
        torch.testing.assert_close(
            got["weights"][name], w, rtol=1e-10, atol=1e-10, msg=lambda m, name=name: f"{name}: {m}"
        )
    # each rank ran its share of the Newton-Schulz work, not all of it
    assert max(got["ns_flops"]) <= 1.3 * single_flops / world
