"""k3 train refuses what would lose a run, before the run: an --out that is a file or cannot be
written, a folder another k3 train is using; it stops at the first NaN or infinite loss or gradient
norm without saving it; a save that fails for any reason (a full disk seen by safetensors, torch or
the OS) is a CheckpointError that leaves the previous checkpoint; checkpoint files get open()'s
permissions."""

from __future__ import annotations

import errno
import hashlib
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch

from k3.io import file_mode
from k3.models import CausalLM
from k3.training import TrainConfig, build_optimizer, loop, train
from k3.training import checkpoint as ckpt_module
from k3.training import step as step_module
from k3.training.checkpoint import CheckpointError, OutputFolderError, claim_output
from k3.training.step import NonFiniteLossError

from ..corpus import write_corpus

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"), docs=4, words=300)


def config(corpus, out, **kw) -> TrainConfig:
    base = dict(
        preset="gpt2-tiny",
        model_overrides={"hidden_size": 16},
        data=str(corpus),
        tokenizer="byte",
        seq_len=16,
        batch_size=2,
        max_steps=4,
        warmup_steps=1,
        eval_every=2,
        eval_tokens=64,
        final_eval_tokens=128,
        out=str(out),
        val_fraction=0.2,
        threads=1,
        device="cpu",
    )
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def checkpoint(corpus, tmp_path_factory):
    """A 1-step run's checkpoint folder."""
    out = tmp_path_factory.mktemp("run") / "ckpt"
    train(config(corpus, out, max_steps=1), progress=False)
    return out


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def no_work(*args, **kwargs):
    raise AssertionError("the run started before its output folder was checked")


def test_an_out_that_is_a_file_is_refused_before_any_work(corpus, tmp_path, monkeypatch):
    (tmp_path / "taken").write_text("not a folder")
    monkeypatch.setattr(loop, "prepare_data", no_work)
    with pytest.raises(OutputFolderError, match=f"--out {tmp_path / 'taken'}: is a file, expected a folder"):
        train(config(corpus, tmp_path / "taken"), progress=False)


def test_an_out_that_cannot_be_written_is_refused_before_any_work(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "prepare_data", no_work)
    out = tmp_path / "locked" / "run"
    if os.geteuid() != 0:
        (tmp_path / "locked").mkdir(mode=0o500)
    else:  # root writes anywhere: a folder it may not create

        def refused(self, *args, **kwargs):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))

        monkeypatch.setattr(Path, "mkdir", refused)
    with pytest.raises(
        OutputFolderError, match=rf"--out {out}: cannot write the checkpoint there \(Permission denied\)"
    ):
        train(config(corpus, out), progress=False)


def test_a_second_run_on_one_folder_is_refused_with_the_first_ones_pid(corpus, tmp_path, monkeypatch):
    out = tmp_path / "run"
    with claim_output(out):
        assert (out / ".k3-train.lock").read_text().strip() == str(os.getpid())
        monkeypatch.setattr(loop, "prepare_data", no_work)
        with pytest.raises(OutputFolderError, match=rf"another k3 train \(pid {os.getpid()}\) is writing"):
            train(config(corpus, out), progress=False)
    assert not (out / ".k3-train.lock").exists()  # released and removed
    claim_output(out).release()


def test_the_lock_of_a_process_that_died_does_not_block(tmp_path):
    out = tmp_path / "run"
    script = f"from k3.training.checkpoint import claim_output; import os; claim_output({str(out)!r}); os._exit(0)"
    subprocess.run([sys.executable, "-c", script], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert (out / ".k3-train.lock").exists()  # left behind, unlocked
    with claim_output(out):
        assert (out / ".k3-train.lock").read_text().strip() == str(os.getpid())


def test_a_nan_loss_stops_the_run_without_saving_it(corpus, tmp_path, monkeypatch):
    calls = {"n": 0}
    real = step_module.next_token_loss

    def nan_at_step_3(model, windows, *rest):
        calls["n"] += 1
        loss = real(model, windows, *rest)
        return loss * math.nan if calls["n"] == 3 else loss

    monkeypatch.setattr(step_module, "next_token_loss", nan_at_step_3)
    with pytest.raises(NonFiniteLossError, match="step 3: the training loss is nan; stopped there without saving"):
        train(config(corpus, tmp_path, checkpoint_every=1), progress=False)
    state = ckpt_module.load_training_checkpoint(tmp_path)
    assert state["step"] == 2 and all(torch.isfinite(t).all() for t in state["model"].values())


def test_a_nan_gradient_stops_the_run(corpus, tmp_path, monkeypatch):
    real = step_module.next_token_loss

    def nan_gradient(model, windows, *rest):  # the same loss; d sqrt(x)/dx at x = 0 is infinite, times 0: NaN
        loss = real(model, windows, *rest)
        return loss + torch.sqrt(next(model.parameters()).sum() * 0)

    monkeypatch.setattr(step_module, "next_token_loss", nan_gradient)
    with pytest.raises(NonFiniteLossError, match=r"step 1: the gradient norm is nan \(the loss is 5\.\d+\)"):
        train(config(corpus, tmp_path, checkpoint_every=1), progress=False)
    assert not (tmp_path / "model.safetensors").exists()


def resave(folder: Path, step: int = 2, weights: dict | None = None) -> None:
    """save_training_checkpoint into `folder` as the loop does, from that folder's own checkpoint."""
    state = ckpt_module.load_training_checkpoint(folder)
    model = CausalLM.from_pretrained(folder)
    cfg = state["train_config"]
    ckpt_module.save_training_checkpoint(
        folder,
        model,
        build_optimizer(model, cfg),
        state["tokenizer"],
        cfg,
        step,
        cfg.max_steps,
        torch.Generator(),
        state["history"],
        weights=weights,
    )


FULL_DISK = {  # how a full disk reaches the save: the writer that meets it, and what it raises
    "safetensors": (
        safetensors.torch,
        "save_file",
        safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
    ),
    "torch": (
        torch,
        "save",
        RuntimeError(
            "[enforce fail at inline_container.cc:783] . PytorchStreamWriter failed writing file data/0: "
            "file write failed"
        ),
    ),
    "os": (ckpt_module, "plot_history", OSError(errno.ENOSPC, "No space left on device")),
    "torch-short": (  # what DCP's writer (an asynchronous save's) meets: torch's short write, no errno
        torch,
        "save",
        RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1536 vs 1453"),
    ),
}


@pytest.mark.parametrize("library", list(FULL_DISK))
def test_a_full_disk_is_a_checkpoint_error_whatever_library_saw_it(checkpoint, tmp_path, monkeypatch, library):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for p in checkpoint.iterdir():
        (folder / p.name).write_bytes(p.read_bytes())
    before = digests(folder)
    owner, name, failure = FULL_DISK[library]

    def full(*args, **kwargs):
        raise failure

    monkeypatch.setattr(owner, name, full)
    with pytest.raises(
        CheckpointError,
        match=rf"could not save the checkpoint to {folder}: .*No space left on device.*; the previous checkpoint",
    ):
        resave(folder)
    with pytest.raises(
        CheckpointError,
        match=rf"could not save the checkpoint to {folder}: .*"
        rf"No space left on device|file write failed.*; the previous checkpoint",
    ):
        resave(folder)
    monkeypatch.undo()
    assert digests(folder) == before  # nothing changed, no temporaries
    assert ckpt_module.load_training_checkpoint(folder)["step"] == 1


def test_a_full_disk_met_by_another_process_is_named_through_the_wrapping(tmp_path):
    """DCP raises on every process an exception whose cause is the process that met the full disk."""
    try:
        try:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1536 vs 1453")
        except RuntimeError as e:
            raise ValueError("rank 1 failed while writing") from e
    except ValueError as wrapped:
        with pytest.raises(CheckpointError, match="No space left on device \\(a write came out short: ValueError"):
            with ckpt_module.saving(tmp_path):
                raise wrapped
    with pytest.raises(CheckpointError, match=r"to .*: ValueError: bad value; the previous") as other:
        with ckpt_module.saving(tmp_path):
            raise ValueError("bad value")
    assert "No space" not in str(other.value)


def test_weights_with_nan_are_never_saved(checkpoint, tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for p in checkpoint.iterdir():
        (folder / p.name).write_bytes(p.read_bytes())
    before = digests(folder)
    weights = CausalLM.from_pretrained(folder).state_dict()
    name = next(iter(weights))
    weights[name] = weights[name] * math.inf
    with pytest.raises(CheckpointError, match=f"not saving the checkpoint of step 2 to {folder}: {name} holds NaN"):
        resave(folder, weights=weights)
    assert digests(folder) == before


def test_checkpoint_files_get_the_permissions_open_gives(checkpoint, tmp_path):
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in checkpoint.iterdir()}
    assert len(modes) == 7 and set(modes.values()) == {oct(file_mode())}, modes  # the checkpoint and metrics.jsonl
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for p in checkpoint.iterdir():
        if p.name != "metrics.jsonl":  # the training loop's log, which a save does not write
            (folder / p.name).write_bytes(p.read_bytes())
    previous = os.umask(0o027)
    try:
        resave(folder)
        CausalLM.from_pretrained(folder).save_pretrained(tmp_path / "pretrained")
    finally:
        os.umask(previous)
    for path in [*folder.iterdir(), *(tmp_path / "pretrained").iterdir()]:
        assert oct(path.stat().st_mode & 0o777) == oct(0o640), path


def test_k3_train_says_a_nan_loss_in_one_line(corpus, tmp_path, monkeypatch, capsys):
    """The command line ends a diverged run with one line and exit code 2, not a traceback."""
    from k3.cli import main

    real = step_module.next_token_loss
    monkeypatch.setattr(
        step_module, "next_token_loss", lambda model, windows, *rest: real(model, windows, *rest) * math.nan
    )
    code = main(
        [
            "train",
            "--preset",
            "gpt2-tiny",
            "--data",
            str(corpus),
            "--tokenizer",
            "byte",
            "--seq-len",
            "16",
            "--batch-size",
            "2",
            "--max-steps",
            "3",
            "--out",
            str(tmp_path / "run"),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("k3 train: error: step 1: the training loss is nan"), err
