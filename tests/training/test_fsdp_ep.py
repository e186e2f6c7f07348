"""`torchrun --nproc_per_node=4 -m k3 train --parallel fsdp --ep 2`: FSDP x expert parallelism on one
DeviceMesh [2 ("efsdp"), 2 ("ep")] over 4 gloo processes takes the single process's steps, with Muon and
AdamW, gradient accumulation and recompute; its sharded checkpoint (each process its own shards) resumes
on 2 processes (fsdp alone), then on one, on the same loss sequence, and 2 expert-parallel processes
generate from it what one does."""

from __future__ import annotations

import os

import pytest
import torch

from k3.models import CausalLM
from k3.training import TrainConfig, build, build_model, loop, train, train_step
from k3.training.build import memory_share
from k3.training.parallel import init_parallel, parallel_dims

from ..corpus import write_corpus
from ..processes import free_port, join, leave

pytestmark = pytest.mark.slow  # 4 spawned processes (gloo), then 2

RTOL = 1e-5
PROMPTS = [[116, 111, 32, 98, 101], [97, 98]]
SMALL = {"hidden_size": 32, "num_layers": 3, "num_experts": 8, "num_experts_per_tok": 2}  # KDA, MoE, MLA + AttnRes


def run_cfg(corpus, out, **kw) -> TrainConfig:
    base = dict(
        preset="kimi-k3-tiny",
        model_overrides=SMALL,
        data=str(corpus),
        tokenizer="byte",
        seq_len=16,
        batch_size=8,
        max_steps=4,
        warmup_steps=2,
        eval_every=2,
        eval_tokens=128,
        final_eval_tokens=256,
        out=str(out),
        val_fraction=0.2,
        device="cpu",
    )
    return TrainConfig(**{**base, **kw})


def _held(rank: int) -> dict:
    """What this rank holds of kimi-k3-tiny (16 experts) under fsdp x ep 2 after a step, beside the planner's
    figures for the same layout (`k3 plan`'s memory model)."""
    from torch.distributed.tensor import DTensor

    from k3.models import get_config
    from k3.plan.shapes import Layout, model_shapes, rank_values

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    dims = init_parallel("fsdp", ep=2)
    config = get_config("kimi-k3-tiny", vocab_size=257)
    model = build_model(config, dims)
    optimizer, _ = build(model, TrainConfig(), dims)
    windows = torch.randint(0, 257, (8, 33), generator=torch.Generator().manual_seed(0))
    train_step(model, optimizer, windows, TrainConfig(), dims)
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # two of the four processes on each machine
    assert memory_share(TrainConfig(), dims) == 0.5 and memory_share(TrainConfig(), dims, whole=True) == 2.0
    held = rank_values(model_shapes(config), Layout(4, 1, 4, 2), rank)
    n = sum(held.values())
    adam_only = held["embedding"] + held["vector"]
    return {
        "values": sum(local(p).numel() for p in model.parameters()),
        "planned values": n,
        "optimizer bytes": sum(
            local(v).numel() * v.element_size()
            for state in optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        ),
        "planned optimizer bytes": 4 * (n - adam_only) + 8 * adam_only,
    }


def _four(rank: int, port: int, corpus: str, root: str) -> None:
    join(rank, 4, port)
    held = [None] * 4
    torch.distributed.all_gather_object(held, _held(rank))
    results = {
        "held": held,
        "muon": train(run_cfg(corpus, f"{root}/muon", ep=2), progress=False, parallel="fsdp"),
        "adamw": train(run_cfg(corpus, f"{root}/adamw", ep=2, optimizer="adamw"), progress=False, parallel="fsdp"),
        "accumulated": train(
            run_cfg(corpus, f"{root}/accumulated", ep=2, batch_size=4, grad_accum=2), progress=False, parallel="fsdp"
        ),
        "recompute": train(
            run_cfg(corpus, f"{root}/recompute", ep=2, recompute="full"), progress=False, parallel="fsdp"
        ),
    }
    train(run_cfg(corpus, f"{root}/chain", ep=2, max_steps=2), progress=False, parallel="fsdp")
    with pytest.raises(ValueError, match="--ep 3 does not divide the 4 processes"):
        train(run_cfg(corpus, f"{root}/bad", ep=3), progress=False, parallel="fsdp")
    if rank == 0:
        torch.save(results, f"{root}/four.pt")
    leave()


def _two(rank: int, port: int, root: str) -> None:
    from k3.training.parallel import load_expert_parallel

    join(rank, 2, port)
    built, build_model = [], loop.build_model

    def spy(config, dims, whole=False):  # how the resumed run builds its model
        model = build_model(config, dims, whole)
        built.append(model.lm_head.weight.is_meta)
        return model

    loop.build_model = spy
    try:
        history = train(
            TrainConfig(max_steps=3, ep=1),
            resume=f"{root}/chain",
            asked=("max_steps", "ep"),
            progress=False,
            parallel="fsdp",
        )
    finally:
        loop.build_model = build_model
    # the sharded checkpoint of 2 processes, read back split over them: each reads only its own experts
    model = load_expert_parallel(f"{root}/chain", torch.device("cpu")).eval()
    rows = model.double().generate(PROMPTS, 8, temperature=0)
    if rank == 0:
        torch.save({"history": history, "rows": rows, "built on meta": built}, f"{root}/two.pt")
    leave()


def shards(folder) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted((folder / "dcp").iterdir())} if (folder / "dcp").exists() else {}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp_ep")
    (root / "corpus").mkdir()
    corpus = write_corpus(root / "corpus", docs=4, words=300)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = {
            "muon": train(run_cfg(corpus, root / "single"), progress=False),
            "adamw": train(run_cfg(corpus, root / "single_adamw", optimizer="adamw"), progress=False),
        }
        torch.multiprocessing.spawn(_four, args=(free_port(), str(corpus), str(root)), nprocs=4)
        files = {"four": (shards(root / "chain"), (root / "chain" / "model.safetensors").exists())}
        torch.multiprocessing.spawn(_two, args=(free_port(), str(root)), nprocs=2)
        files["two"] = (shards(root / "chain"), (root / "chain" / "model.safetensors").exists())
        two = torch.load(root / "two.pt", weights_only=False)
        two["one process rows"] = (
            CausalLM.from_pretrained(root / "chain").double().eval().generate(PROMPTS, 8, temperature=0)
        )
        resumed = train(TrainConfig(max_steps=4), resume=str(root / "chain"), asked=("max_steps",), progress=False)
        files["one"] = (shards(root / "chain"), (root / "chain" / "model.safetensors").exists())
    finally:
        torch.set_num_threads(threads)
    four = torch.load(root / "four.pt", weights_only=False)
    return reference, four | {"files": files}, two, resumed


def assert_follows(history: dict, reference: dict, steps: int | None = None) -> None:
    steps = steps or len(reference["loss"])
    assert history["step"] == reference["step"][:steps]
    assert history["loss"] == pytest.approx(reference["loss"][:steps], rel=RTOL)


@pytest.mark.parametrize(
    "case,reference", [("muon", "muon"), ("adamw", "adamw"), ("accumulated", "muon"), ("recompute", "muon")]
)
def test_four_processes_fsdp_x_ep_take_the_single_process_steps(runs, case, reference):
    single, four, _, _ = runs
    assert_follows(four[case], single[reference])
    assert four[case]["val_bpb"] == pytest.approx(single[reference]["val_bpb"], rel=RTOL)
    assert four[case]["final_val_bpb"] == pytest.approx(single[reference]["final_val_bpb"], rel=RTOL)


def test_each_rank_holds_what_the_planner_says(runs):
    """k3 plan's per-rank parameter values and Muon + AdamW state bytes equal what each of the 4 real
    processes holds (the sharded tensors' local sizes), rank by rank."""
    held = runs[1]["held"]
    for rank in held:
        assert rank["values"] == rank["planned values"]
        assert rank["optimizer bytes"] == rank["planned optimizer bytes"]
    assert len({rank["values"] for rank in held}) > 1  # the ranks differ (uneven row splits), and so does the plan


def test_a_checkpoint_of_four_processes_resumes_on_two_then_one(runs):
    single, _, two, one = runs
    assert_follows(two["history"], single["muon"], steps=3)
    assert_follows(one, single["muon"])
    assert one["final_val_bpb"] == pytest.approx(single["muon"]["final_val_bpb"], rel=RTOL)


def test_each_process_writes_its_own_shards_and_none_gathers_the_model(runs):
    """The checkpoint of 4 processes is 4 DCP files (rank r's shards in __r_0.distcp) and its .metadata,
    no model.safetensors; each file holds about a quarter of the training state. Resumed on 2 processes
    it becomes 2 files (the 4-process ones removed at the commit), on one process a whole checkpoint."""
    files = runs[1]["files"]
    four, whole = files["four"]
    assert sorted(four) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"] and not whole
    state = sum(size for name, size in four.items() if name != ".metadata")
    assert all(0.15 * state < four[f"__{r}_0.distcp"] < 0.35 * state for r in range(4)), four
    two, whole = files["two"]
    assert sorted(two) == [".metadata", "__0_0.distcp", "__1_0.distcp"] and not whole
    assert runs[2]["built on meta"] == [True]  # the resumed processes never held the whole model
    assert files["one"] == ({}, True)


def test_a_sharded_checkpoint_read_by_two_expert_parallel_processes_generates_what_one_does(runs):
    two = runs[2]
    assert [row.tolist() for row in two["rows"]] == [row.tolist() for row in two["one process rows"]]


def test_ep_is_refused_outside_fsdp(monkeypatch):
    with pytest.raises(ValueError, match="--ep 2 is for --parallel fsdp"):
        parallel_dims("ep", 4, ep=2)
    with pytest.raises(ValueError, match="--ep 2 is for --parallel fsdp"):
        parallel_dims("none", 4, ep=2)
