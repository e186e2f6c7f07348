"""k3 train on 2 CPU processes (gloo): ddp, fsdp and expert parallelism give the single process's
losses (two steps), clipped gradients, and the weights, AdamW moments and MoE biases a checkpoint
holds after a step; checkpoints move between world sizes both ways and the resumed runs follow the
single-process loss sequence; --grad-accum 2 in each mode follows the single process's larger batch.

Tolerance: fp32, relative 1e-5 in norm (the ranks sum in another order than the single process;
measured: losses 1e-7, gradients 9e-7); weights entrywise within 1e-2 lr (see below). One spawn of 2
processes does all the distributed work.
"""

from __future__ import annotations

import copy
import datetime
import math
import os
import shutil

import pytest
import torch

from k3.models import CausalLM, get_config
from k3.training import TrainConfig, build, build_model, build_optimizer, train, train_step, training_step
from k3.training.checkpointer import Checkpointer
from k3.training.optim import portable_state
from k3.training.parallel import check_expert_split, init_parallel, parallel_dims

from ..corpus import write_corpus
from ..processes import free_port, leave, merged_over_ranks

pytestmark = pytest.mark.slow  # 2 spawned processes (gloo) for every mode

RTOL = 1e-5
WORLD = 2
# (preset, mode): kimi-k3-tiny has Block AttnRes, KDA, MLA and MoE layers; gpt2-tiny ties its head to the
# embedding
CASES = [("kimi-k3-tiny", "ddp"), ("kimi-k3-tiny", "fsdp"), ("kimi-k3-tiny", "ep"), ("gpt2-tiny", "fsdp")]
STEP_CFG = TrainConfig(lr=3e-3, grad_clip=0.5, moe_bias_rate=1e-2)
# KDA, KDA + MoE, MLA + MoE with Block AttnRes: kimi-k3-tiny's parts in fewer tensors (each costs
# FSDP and DTensor time on two busy cores)
SMALL = {"hidden_size": 32, "num_layers": 3, "num_experts": 8, "num_experts_per_tok": 2}
VOCAB = 257  # the byte tokenizer's, as in the training runs below: the same tensor shapes warm up once


def tiny_model(preset: str) -> CausalLM:
    torch.manual_seed(0)
    overrides = SMALL if preset == "kimi-k3-tiny" else {"hidden_size": 32, "num_layers": 2}
    return CausalLM(get_config(preset, vocab_size=VOCAB, **overrides))


def batches() -> list[torch.Tensor]:
    """Two global batches of 2 windows x 4 tokens: 8 tokens x top-2 over 8 experts leave some experts
    without tokens on one rank and some without tokens at all (asserted below)."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2, 5), generator=g) for _ in range(2)]


def run_cfg(corpus, out, **kw) -> TrainConfig:
    base = dict(
        preset="kimi-k3-tiny",
        model_overrides=SMALL,
        data=str(corpus),
        tokenizer="byte",
        seq_len=16,
        batch_size=4,
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


# -- what each of the 2 processes runs --------------------------------------------------------------
def _full_grads(model) -> dict:
    """Every parameter's gradient as one full tensor (None where it has none), the same on all ranks."""
    from torch.distributed.tensor import DTensor

    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grads[name] = None if g is None else g.detach().clone()
    return merged_over_ranks(grads)


def _two_steps(preset: str, mode: str) -> dict:
    dims = init_parallel(mode)
    model = tiny_model(preset)
    optimizer, groups = build(model, STEP_CFG, dims)
    if mode == "fsdp":  # whole decoder layers are the units, Block AttnRes or not
        from torch.distributed.fsdp import FSDPModule

        units = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
        assert units == [""] + [f"model.layers.{i}" for i in range(len(model.model.layers))], units
    first, second = batches()
    losses = [train_step(model, optimizer, first, STEP_CFG, dims).loss]
    grads = _full_grads(model)
    weights, optimizer_state = copy.deepcopy(Checkpointer(model, optimizer, dims, groups).full_state())
    losses.append(train_step(model, optimizer, second, STEP_CFG, dims).loss)
    return {"losses": losses, "grads": grads, "weights": weights, "optimizer": optimizer_state}


def _built_on_meta(preset: str, mode: str) -> dict:
    """The model as `k3 train` builds it under torchrun: on meta, split, then each rank's share made."""
    from torch.distributed.tensor import DTensor

    dims = init_parallel(mode)
    torch.manual_seed(0)
    overrides = SMALL if preset == "kimi-k3-tiny" else {"hidden_size": 32, "num_layers": 2}
    model = build_model(get_config(preset, vocab_size=VOCAB, **overrides), dims)
    assert model.lm_head.weight.is_meta
    build(model, STEP_CFG, dims)
    held = sum(t.to_local().numel() if isinstance(t, DTensor) else t.numel() for t in model.state_dict().values())
    state = {n: t.full_tensor() if isinstance(t, DTensor) else t for n, t in model.state_dict().items()}
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    return {"state": merged_over_ranks(state), "held": held, "tied": tied}


def _peak_rss_of_a_large_model_on_meta() -> dict:
    """fsdp over 2 processes of a model of 212M parameters (810 MiB in fp32): how much each one grew
    (measured: 499 MiB each built on meta, 998 MiB each built whole)."""
    import resource

    dims = init_parallel("fsdp")
    config = get_config(
        "kimi-k3-tiny",
        vocab_size=VOCAB,
        hidden_size=512,
        num_experts=64,
        moe_intermediate_size=512,
        moe_latent_size=512,
    )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model = build_model(config, dims)
    build(model, STEP_CFG, dims)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {
        "grown": grown,
        "whole": 4 * model.num_parameters(),
        "norm": float(sum(p.to_local().double().pow(2).sum() for p in model.parameters())),
    }


def _worker(rank: int, port: int, corpus: str, root: str) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    results = {case: _two_steps(*case) for case in CASES}
    for case in (("kimi-k3-tiny", "fsdp"), ("kimi-k3-tiny", "ep"), ("kimi-k3-tiny", "ddp"), ("gpt2-tiny", "fsdp")):
        results[("meta",) + case] = _built_on_meta(*case)
    results["large"] = _peak_rss_of_a_large_model_on_meta()
    norms = [None] * WORLD
    torch.distributed.all_gather_object(norms, results["large"]["norm"])
    results["large"]["norms"] = norms
    # a checkpoint written by 2 processes (the other modes' gathered states are checked above), and
    # single-process checkpoints resumed by 2
    results["ep2"] = train(run_cfg(corpus, f"{root}/ep2", max_steps=2), progress=False, parallel="ep")
    # --parallel ep is fsdp x ep with the experts over all processes and the dense part whole: the same steps
    results["fsdp_ep2"] = train(run_cfg(corpus, f"{root}/fsdp_ep2", max_steps=2, ep=2), progress=False, parallel="fsdp")
    for mode in ("fsdp", "ep"):
        results[f"resumed_{mode}"] = train(
            TrainConfig(max_steps=4), resume=f"{root}/single2_{mode}", progress=False, parallel=mode
        )
    results["resumed_unchosen"] = train(
        TrainConfig(max_steps=3), resume=f"{root}/single2_unchosen", progress=False, parallel="fsdp"
    )
    for mode, recompute in (("fsdp", "full"), ("ep", "selective")):  # the layers' forwards run again
        results[f"recompute_{mode}"] = train(
            run_cfg(corpus, f"{root}/recompute_{mode}", recompute=recompute), progress=False, parallel=mode
        )
    for mode in ("ddp", "fsdp", "ep"):  # 2 micro-batches of 2 windows, one per rank: the reference's steps
        results[f"accumulated_{mode}"] = train(
            run_cfg(corpus, f"{root}/accumulated_{mode}", batch_size=2, grad_accum=2), progress=False, parallel=mode
        )
    if rank == 0:
        torch.save(results, f"{root}/results.pt")
    leave()


UNCHOSEN = "model.layers.1.block_sparse_moe.experts.3.w1"


def without_state(source, folder, name: str) -> None:
    """A copy of the checkpoint `source` in which parameter `name` has no optimizer state, as an expert no
    token has chosen yet has none (its manifest dropped: the copy is not the save's)."""
    from k3.training.checkpoint import load_training_checkpoint
    from k3.training.config import model_config
    from k3.training.optim import build_optimizer, flat_names, group_names

    shutil.copytree(source, folder)
    state = load_training_checkpoint(folder)
    model = CausalLM(model_config(state["train_config"], state["tokenizer"].vocab_size))
    names = flat_names(group_names(model, build_optimizer(model, state["train_config"])))
    trainer = torch.load(folder / "trainer_state.pt", weights_only=True)
    del trainer["optimizer"]["state"][names.index(name)]
    torch.save(trainer, folder / "trainer_state.pt")
    (folder / ".k3-manifest.json").unlink()


# -- the single process, and the comparisons ---------------------------------------------------------
@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two processes on two cores; and the single-process reference alike
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"), docs=4, words=300)


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory, one_thread):
    """The single-process reference run, then one spawn of 2 processes doing all the distributed work."""
    root = tmp_path_factory.mktemp("runs")
    reference = train(run_cfg(corpus, root / "single4"), progress=False)
    train(run_cfg(corpus, root / "single2_fsdp", max_steps=2), progress=False)
    shutil.copytree(root / "single2_fsdp", root / "single2_ep")
    without_state(root / "single2_fsdp", root / "single2_unchosen", UNCHOSEN)
    torch.multiprocessing.spawn(_worker, args=(free_port(), str(corpus), str(root)), nprocs=WORLD)
    return root, reference, torch.load(root / "results.pt", weights_only=False)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def assert_same_tensors(got: dict, want: dict, what: str, atol: float = 0.0, rtol: float = RTOL) -> None:
    """Each tensor within `rtol` of the reference (in norm), or every entry within `atol`."""
    assert got.keys() == want.keys(), f"{what}: keys differ: {sorted(set(got) ^ set(want))[:5]}"
    for name, w in want.items():
        g = got[name]
        assert (g is None) == (w is None), f"{what} {name}: one is None"
        if w is not None:
            worst = float((g - w).abs().max()) if w.numel() else 0.0
            assert relative(g, w) <= rtol or worst <= atol, (
                f"{what} {name}: relative difference {relative(g, w):.2e}, largest {worst:.2e}"
            )


@pytest.mark.parametrize("preset,mode", CASES)
def test_two_processes_take_the_single_process_steps(runs, preset, mode):
    _, _, results = runs
    got = results[(preset, mode)]
    model = tiny_model(preset)
    optimizer = build_optimizer(model, STEP_CFG)
    first, second = batches()
    losses = [training_step(model, optimizer, first, STEP_CFG)]
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    assert_same_tensors(got["grads"], grads, "gradient")
    norm = torch.nn.utils.get_total_norm([g for g in grads.values() if g is not None])
    assert float(norm) == pytest.approx(STEP_CFG.grad_clip, rel=1e-4)  # clipping was active
    # AdamW's first update is lr g / (|g| + eps): gradient entries near eps = 1e-8 are left over from
    # cancellations and carry ~1% rounding, which moves their weights by up to 2e-3 lr (measured)
    assert_same_tensors(got["weights"], model.state_dict(), "weight", atol=1e-2 * STEP_CFG.lr)  # MoE biases too
    want = optimizer.state_dict()
    # the same settings, up to the implementation (fused AdamW on plain tensors, the default on FSDP's shards)
    assert portable_state(got["optimizer"])["param_groups"] == portable_state(want)["param_groups"]
    for i, moments in want["state"].items():  # exp_avg_sq holds g^2: twice the gradient's relative error
        assert_same_tensors(got["optimizer"]["state"][i], moments, f"AdamW state of parameter {i}", rtol=2 * RTOL)
    losses.append(training_step(model, optimizer, second, STEP_CFG))
    assert got["losses"] == pytest.approx(losses, rel=RTOL)
    if "moe" in model.config.mlp_types:  # the paths for experts unused on one rank, or on all, were taken
        assert any(g is None for n, g in grads.items() if ".experts." in n)
        fresh = tiny_model(preset)
        loads = []
        with torch.no_grad():
            for half in first.split(1):
                fresh(half[:, :-1])
                loads.append(torch.stack([m.last_load for m in fresh.moe_layers()]))
        assert bool(((loads[0] == 0) != (loads[1] == 0)).any())


@pytest.mark.parametrize(
    "preset,mode", [("kimi-k3-tiny", "fsdp"), ("kimi-k3-tiny", "ep"), ("kimi-k3-tiny", "ddp"), ("gpt2-tiny", "fsdp")]
)
def test_a_model_built_on_meta_and_split_gets_the_one_process_weights(runs, preset, mode):
    """Under torchrun the model is built on the meta device, split, and each rank initialises its share:
    the same tensors, bit for bit, as one process builds with the same seed (each parameter's values come
    from its name), and a rank holds only its share."""
    got = runs[2][("meta", preset, mode)]
    want = tiny_model(preset).state_dict()
    assert got["state"].keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got["state"][name], tensor), name
    whole = sum(t.numel() for t in want.values())
    if mode == "fsdp":
        assert got["held"] <= whole // WORLD + 1000  # 1/N of every tensor (a row's rounding apart)
    elif mode == "ep":
        assert got["held"] < whole
    assert got["tied"] == (preset == "gpt2-tiny")


def test_a_large_model_is_never_whole_in_one_process(runs):
    """fsdp of a 212M-parameter model: each process grows by about its half, never by the whole."""
    large = runs[2]["large"]
    assert large["grown"] < 0.75 * large["whole"], large
    assert all(n > 0 for n in large["norms"])  # both ranks initialised their shards


def assert_follows(history: dict, reference: dict) -> None:
    assert history["step"] == reference["step"]
    assert history["loss"] == pytest.approx(reference["loss"], rel=RTOL)
    assert history["val_bpb"] == pytest.approx(reference["val_bpb"], rel=RTOL)
    assert history["final_val_bpb"] == pytest.approx(reference["final_val_bpb"], rel=RTOL)


@pytest.mark.parametrize("mode", ["ddp", "fsdp", "ep"])
def test_gradient_accumulation_over_two_processes_takes_the_single_process_steps(runs, mode):
    """--grad-accum 2 with 2 windows a micro-batch, one per rank, follows the single process's batch of 4."""
    _, reference, results = runs
    assert_follows(results[f"accumulated_{mode}"], reference)


@pytest.mark.parametrize("mode", ["fsdp", "ep"])
def test_recompute_over_two_processes_takes_the_single_process_steps(runs, mode):
    """fsdp with full recompute, ep with selective (the all-to-all exchanges run again in the backward)."""
    _, reference, results = runs
    assert_follows(results[f"recompute_{mode}"], reference)


def test_a_two_process_checkpoint_resumes_in_one_process(runs):
    root, reference, _ = runs
    written = torch.load(root / "ep2" / "trainer_state.pt", weights_only=True)
    assert written["step"] == 2 and written["history"]["loss"] == pytest.approx(reference["loss"][:2], rel=RTOL)
    assert CausalLM.from_pretrained(root / "ep2").config.num_experts == 8  # every expert, from both processes
    assert_follows(train(TrainConfig(max_steps=4), resume=str(root / "ep2"), progress=False), reference)


def test_parallel_ep_takes_the_steps_of_fsdp_with_ep_over_all_processes(runs):
    """`--parallel ep` (an alias: the experts split over the 2 processes, the dense part whole in each)
    and `--parallel fsdp --ep 2` of the same seed give the same losses."""
    _, reference, results = runs
    assert results["ep2"]["step"] == results["fsdp_ep2"]["step"] == [1, 2]
    for key in ("loss", "val_bpb", "final_val_bpb"):
        assert results["ep2"][key] == pytest.approx(results["fsdp_ep2"][key], rel=RTOL)
    assert results["ep2"]["loss"] == pytest.approx(reference["loss"][:2], rel=RTOL)


def test_a_one_process_checkpoint_with_a_parameter_without_optimizer_state_resumes_under_fsdp(runs):
    """An expert that no token chose in the single process has no optimizer state; fsdp's load of the
    whole checkpoint leaves it without one (it used to refuse the checkpoint), as the single process does."""
    history = runs[2]["resumed_unchosen"]
    assert history["step"] == [1, 2, 3] and all(math.isfinite(loss) for loss in history["loss"])


@pytest.mark.parametrize("mode", ["fsdp", "ep"])
def test_a_one_process_checkpoint_resumes_in_two_processes(runs, mode):
    root, reference, results = runs
    assert_follows(results[f"resumed_{mode}"], reference)


def test_bad_requests_are_refused_with_the_reason(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert parallel_dims("none", 4).world == 1
    with pytest.raises(ValueError, match="--parallel must be one of none, ddp, fsdp, ep, got 'zero'"):
        parallel_dims("zero", 4)
    with pytest.raises(ValueError, match="runs under torchrun .missing RANK, WORLD_SIZE"):
        parallel_dims("ddp", 4)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="--parallel none, but torchrun started 2 processes"):
        parallel_dims("none", 4)
    for name, value in dict(RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="--batch-size must be a multiple of the 2 processes .*, got 5"):
        parallel_dims("fsdp", 5)
    with pytest.raises(ValueError, match="--parallel ep needs a model with MoE layers; gpt2-tiny has none"):
        check_expert_split(get_config("gpt2-tiny"), 2)
    with pytest.raises(ValueError, match="the 16 experts of each MoE layer do not split evenly over 3 processes"):
        check_expert_split(get_config("kimi-k3-tiny"), 3)
