"""Sharded checkpoints (torch.distributed.checkpoint files in dcp/, k3.checkpoints.dcp), written here by
one process through the same `save_sharded` the processes of --parallel fsdp|ep call: they resume on
the uninterrupted run's losses, `CausalLM.from_pretrained`, `k3 export` and `k3 generate` read them one
tensor at a time, a save stopped at any file operation leaves the previous checkpoint (a whole one) or
the new, and a damaged shard is refused by name, the processes sharing the hashing. Several processes
writing and resuming one at other process counts and meshes: tests/training/test_fsdp_ep.py."""

from __future__ import annotations

import copy
import shutil
import threading
from pathlib import Path

import pytest
import torch

import k3.checkpoints.dcp as dcp
from k3.cli import main
from k3.io import JOURNAL, CheckpointError, check_manifest
from k3.models import CausalLM
from k3.training import TrainConfig, train
from k3.training import checkpoint as ckpt_module
from k3.training.checkpointer import Checkpointer
from k3.training.sharded import save_sharded

from ..corpus import write_corpus
from .test_checkpoint_atomic import Died, Faults

SMALL = {"hidden_size": 32, "num_layers": 3, "num_experts": 8, "num_experts_per_tok": 2}  # KDA, MoE, MLA + AttnRes


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
        eval_tokens=64,
        final_eval_tokens=128,
        checkpoint_every=2,
        out=str(out),
        val_fraction=0.2,
        threads=1,
        device="cpu",
    )
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 4-step run (whole checkpoints) and the same run saving sharded checkpoints at steps 2 and 4,
    each save's arguments kept to make it again (`replay`); "A": the whole checkpoint of step 2, "S2",
    "S4": the sharded ones."""
    root = tmp_path_factory.mktemp("sharded")
    (root / "corpus").mkdir()
    corpus = write_corpus(root / "corpus", docs=4, words=300)
    full = train(run_cfg(corpus, root / "full"), progress=False)
    train(run_cfg(corpus, root / "A", max_steps=2), progress=False)
    saves = {}

    def sharded(self, out, tokenizer, cfg, step, max_steps, generator, history):
        saves[step] = dict(
            checkpointer=copy.deepcopy(self),
            tokenizer=tokenizer,
            cfg=cfg,
            step=step,
            max_steps=max_steps,
            data_rng=generator.get_state(),
            torch_rng=torch.get_rng_state(),
            history=copy.deepcopy(history),
        )
        save_sharded(self, Path(out), tokenizer, cfg, step, max_steps, generator, history)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Checkpointer, "save", sharded)
        sharded_run = train(run_cfg(corpus, root / "S4"), progress=False)
    replay(saves[2], root / "S2")
    return {"full": full, "sharded": sharded_run, "saves": saves, "root": root}


def replay(save: dict, out: Path, asynchronous: bool = False) -> None:
    """Make the save again; `asynchronous`: as `--async-checkpoint` does (the files written by a thread,
    then committed)."""
    torch.set_rng_state(save["torch_rng"])
    generator = torch.Generator()
    generator.set_state(save["data_rng"])
    pending = save_sharded(
        save["checkpointer"],
        out,
        save["tokenizer"],
        save["cfg"],
        save["step"],
        save["max_steps"],
        generator,
        save["history"],
        asynchronous=asynchronous,
    )
    assert (pending is not None) == asynchronous
    if pending is not None:
        pending.finish()


def files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def test_a_sharded_checkpoint_holds_dcp_files_and_resumes_on_the_same_losses(run):
    root = run["root"]
    assert run["sharded"]["loss"] == run["full"]["loss"]
    assert files(root / "S2") == [
        ".k3-manifest.json",
        "config.json",
        "dcp/.metadata",
        "dcp/__0_0.distcp",
        "loss.png",
        "tokenizer.json",
        "trainer_state.pt",
    ]
    state = ckpt_module.load_training_checkpoint(root / "S2")
    assert state["model"] is None and state["sharded"] == root / "S2" and state["step"] == 2
    assert "state" not in state["optimizer"] and state["optimizer"]["param_groups"]  # the tensors are in dcp/
    resumed = train(TrainConfig(), resume=str(root / "S2"), progress=False)
    assert resumed["loss"] == run["full"]["loss"] and resumed["val_bpb"] == run["full"]["val_bpb"]
    assert (root / "S2" / "model.safetensors").exists() and not (root / "S2" / "dcp").exists()  # one process: whole


def test_an_asynchronous_save_holds_the_state_of_its_step_and_commits_only_when_finished(run, tmp_path, monkeypatch):
    """`--async-checkpoint`: once `save_sharded` returns, the state is copied: the model and optimizer may
    change (the next steps) and the files still hold the saved step's; the folder holds nothing new until
    `finish()`, which commits the same checkpoint a synchronous save writes."""
    save = run["saves"][4]
    checkpointer = copy.deepcopy(save["checkpointer"])
    generator = torch.Generator()
    generator.set_state(save["data_rng"])
    torch.set_rng_state(save["torch_rng"])
    args = (save["tokenizer"], save["cfg"], save["step"], save["max_steps"], generator, save["history"])
    release, real_save = threading.Event(), torch.save

    def held_save(*a, **kw):  # the writer thread waits until the training has changed everything
        assert release.wait(60)
        return real_save(*a, **kw)

    monkeypatch.setattr(torch, "save", held_save)
    pending = save_sharded(checkpointer, tmp_path / "async", *args, asynchronous=True)
    assert not pending.done()
    with torch.no_grad():  # the training goes on: every weight and momentum changes
        for p in checkpointer.model.parameters():
            p.add_(1.0)
        for state in checkpointer.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    value.add_(1.0)
    save["history"]["loss"].append(123.0)  # (and the history grows)
    release.set()
    monkeypatch.setattr(torch, "save", real_save)
    assert not (tmp_path / "async" / "trainer_state.pt").exists()
    pending.finish()
    saved = CausalLM.from_pretrained(tmp_path / "async")
    want = CausalLM.from_pretrained(run["root"] / "S4")
    for (name, a), (_, b) in zip(saved.state_dict().items(), want.state_dict().items()):
        assert torch.equal(a, b), name
    assert files(tmp_path / "async") == [f for f in files(run["root"] / "S4") if f != "metrics.jsonl"]
    history = ckpt_module.load_training_checkpoint(tmp_path / "async")["history"]
    assert 123.0 not in history["loss"]
    save["history"]["loss"].pop()


def test_from_pretrained_export_and_generate_read_it_one_tensor_at_a_time(run, tmp_path, monkeypatch):
    source = tmp_path / "S4"
    shutil.copytree(run["root"] / "S4", source)
    expected = run["saves"][4]["checkpointer"].model.state_dict()
    reads = []
    real = dcp.load_sharded_state
    monkeypatch.setattr(
        dcp,
        "load_sharded_state",
        lambda state, reader, no_dist: (reads.append(list(state)), real(state, reader, no_dist)),
    )
    model = CausalLM.from_pretrained(source)
    assert model.state_dict().keys() == expected.keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    weights = [k for k in model.state_dict() if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    assert sorted(key for keys in reads for key in keys) == sorted(["step"] + [f"model.{k}" for k in weights])
    assert all(len(keys) == 1 for keys in reads)  # never more than one tensor in memory besides the model
    assert main(["export", str(source), str(tmp_path / "hf")]) == 0
    exported = CausalLM.from_pretrained(tmp_path / "hf")
    assert all(torch.equal(t, expected[n]) for n, t in exported.state_dict().items())
    assert (
        main(
            [
                "generate",
                "--checkpoint",
                str(source),
                "--prompt",
                "to be",
                "--max-new-tokens",
                "4",
                "--temperature",
                "0",
            ]
        )
        == 0
    )


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("mode", ["error", "death"])
def test_a_sharded_save_stopped_at_any_file_operation_leaves_one_whole_checkpoint(
    run, tmp_path, monkeypatch, mode, asynchronous
):
    """The step-4 sharded save replayed over the step-2 whole checkpoint, stopped at each of its file
    operations (the DCP write counted as one), written at once or asynchronously (`--async-checkpoint`:
    the DCP files by a thread, then the commit): the folder reads as the one or the other, with no
    temporaries, no staging folder and no file of the other set."""
    import torch.distributed.checkpoint as dcp

    root = run["root"]
    monkeypatch.setattr(ckpt_module, "plot_history", lambda history, path, title: Path(path).write_bytes(b"png"))
    expected = {"previous": files(root / "A"), "new": files(root / "S4")}
    counted = Faults()
    with monkeypatch.context() as patch:
        counted.install(patch)
        patch.setattr(dcp, "save", counted.wrap("dcp.save", dcp.save))
        patch.setattr(dcp, "async_save", counted.wrap("dcp.save", dcp.async_save))
        replay(run["saves"][4], tmp_path / "count", asynchronous)
    positions = len(counted.ops)
    assert positions >= 25, counted.ops
    # DCP writes each tensor with a torch.save into the staging folder: of that run (all before the
    # commit point, alike) the first, middle and last are stopped at; every other operation is
    inside = [
        at
        for at in range(1, positions + 1)
        if counted.ops[at - 1] == "torch.save"
        and "dcp.save" in counted.ops[: at - 1]
        and "save_file" not in counted.ops[: at - 1]
        and "Tokenizer.save" not in counted.ops[: at - 1]
    ]
    kept = set(inside[:1] + inside[len(inside) // 2 : len(inside) // 2 + 1] + inside[-1:])
    chosen = [at for at in range(1, positions + 1) if at not in inside or at in kept]
    outcomes = []
    for at in chosen:
        folder = tmp_path / f"at{at}"
        shutil.copytree(root / "A", folder)
        faults, error = Faults(at, mode), None
        with monkeypatch.context() as patch:
            faults.install(patch)
            patch.setattr(dcp, "save", faults.wrap("dcp.save", dcp.save))
            patch.setattr(dcp, "async_save", faults.wrap("dcp.save", dcp.async_save))
            try:
                replay(run["saves"][4], folder, asynchronous)
            except (Died, CheckpointError) as e:
                error = e
        where = f"{mode} at operation {at} ({counted.ops[at - 1]})"
        state = ckpt_module.load_training_checkpoint(folder)  # the next reader: recovers, checks
        outcome = "new" if state["step"] == 4 else "previous"
        assert files(folder) == expected[outcome], where
        assert not any(p.name.endswith(".tmp") or p.name == JOURNAL for p in folder.rglob("*")), where
        if error is None:
            assert outcome == "new", where
        elif isinstance(error, CheckpointError):
            assert ("intact" in str(error)) == (outcome == "previous"), (where, str(error))
        outcomes.append(outcome)
    assert set(outcomes) == {"previous", "new"}
    print(
        f"{mode}: {positions} positions ({len(chosen)} stopped at), {outcomes.count('new')} ended with the new "
        f"checkpoint"
    )
    if mode == "death" and not asynchronous:  # the first position that kept the new one resumes on the run's losses
        first_new = tmp_path / f"at{chosen[outcomes.index('new')]}"
        resumed = train(TrainConfig(), resume=str(first_new), progress=False)
        assert resumed["loss"] == run["full"]["loss"]


def test_a_damaged_shard_is_refused_by_name_by_the_process_that_hashes_it(run, tmp_path):
    folder = tmp_path / "S4"
    shutil.copytree(run["root"] / "S4", folder)
    shard = folder / "dcp" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a tensor's byte; same size: only its hash tells
    shard.write_bytes(bytes(data))
    listed = sorted(check_manifest(folder, names=[])["files"])
    hasher = listed.index("dcp/__0_0.distcp") % 2
    with pytest.raises(CheckpointError, match=r"__0_0.distcp has sha256"):
        ckpt_module.load_training_checkpoint(folder, share=(hasher, 2))
    ckpt_module.load_training_checkpoint(folder, share=(1 - hasher, 2))  # its size is right: the other passes
    with pytest.raises(CheckpointError, match=r"__0_0.distcp has sha256"):
        CausalLM.from_pretrained(folder)
    shard.write_bytes(bytes(data[:-100]))
    (folder / ".k3-manifest.json").unlink()  # no manifest to compare with: the reader's own error names the folder
    with pytest.raises(CheckpointError, match=r"dcp: its files could not be read .* damaged or incomplete"):
        CausalLM.from_pretrained(folder)
    shutil.copytree(run["root"] / "S4", folder, dirs_exist_ok=True)
    shard.write_bytes(bytes(data[:-1]))
    with pytest.raises(CheckpointError, match=r"__0_0.distcp has \d+ bytes"):
        ckpt_module.load_training_checkpoint(folder, share=(1 - hasher, 2))
