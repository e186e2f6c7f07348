"""Checkpoints are all-or-nothing: a save that fails or dies at any one of its file operations leaves
the previous checkpoint or the new one, never a mix, with no temporaries once it is read again; and a
resume from what is left reproduces the uninterrupted run exactly. Once more with a real SIGKILL of a
process that saves in a loop."""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import zipfile
from pathlib import Path

import pytest
import safetensors.torch
import torch

import k3.io
from k3.cli import main
from k3.cli.preflight import check_checkpoint
from k3.io import JOURNAL, MANIFEST, CheckpointError
from k3.tokenizer import Tokenizer
from k3.training import TrainConfig, checkpointer, train
from k3.training import checkpoint as ckpt_module

from ..corpus import write_corpus

ROOT = Path(__file__).resolve().parents[2]


class Died(BaseException):
    """The simulated death of the saving process."""


class Faults:
    """Counts a save's file operations (k3.io's os and tempfile calls and the five writers) and makes
    the `at`-th (from 1) fail: mode "error" raises OSError(ENOSPC) there, once; mode "death" raises
    Died there and at every later operation, so that, as after a SIGKILL, nothing more reaches the
    disk (no cleanup either)."""

    OS = ("replace", "unlink", "chmod", "open", "fsync")

    def __init__(self, at: int | None = None, mode: str = "error"):
        self.at, self.mode, self.ops, self.dead = at, mode, [], False

    def hit(self, name: str) -> None:
        if self.dead:
            raise Died(name)
        self.ops.append(name)
        if len(self.ops) == self.at:
            if self.mode == "death":
                self.dead = True
                raise Died(name)
            raise OSError(errno.ENOSPC, "No space left on device")

    def wrap(self, name: str, fn):
        def wrapped(*args, **kwargs):
            self.hit(name)
            return fn(*args, **kwargs)

        return wrapped

    def install(self, monkeypatch) -> None:
        faults = self

        class CountedOs:
            def __getattr__(self, name):
                attr = getattr(os, name)
                return faults.wrap(f"os.{name}", attr) if name in Faults.OS else attr

        class CountedTempfile:
            def __getattr__(self, name):
                attr = getattr(tempfile, name)
                return faults.wrap(f"tempfile.{name}", attr) if name == "mkstemp" else attr

        for module in (k3.io.atomic, k3.io.journal, k3.io.manifest):  # k3.io's modules
            monkeypatch.setattr(module, "os", CountedOs())
            if hasattr(module, "tempfile"):
                monkeypatch.setattr(module, "tempfile", CountedTempfile())
        monkeypatch.setattr(safetensors.torch, "save_file", self.wrap("save_file", safetensors.torch.save_file))
        monkeypatch.setattr(torch, "save", self.wrap("torch.save", torch.save))
        monkeypatch.setattr(Tokenizer, "save", self.wrap("Tokenizer.save", Tokenizer.save))
        monkeypatch.setattr(ckpt_module, "plot_history", self.wrap("plot_history", ckpt_module.plot_history))
        monkeypatch.setattr(Path, "write_text", self.wrap("Path.write_text", Path.write_text))


def digests(folder: Path) -> dict[str, str]:
    """A sha256 of each checkpoint file's content, not counting what differs between two writes of the
    same content: torch.save's random id and archive folder name (the temporary's), and the order of
    the keys in a safetensors header."""
    found = {}
    for name in ckpt_module.FILES:
        sha = hashlib.sha256()
        data = (folder / name).read_bytes()
        if name.endswith(".pt"):
            with zipfile.ZipFile(folder / name) as archive:
                for member in sorted(archive.namelist(), key=lambda m: m.split("/", 1)[1]):
                    if not member.endswith("serialization_id"):
                        sha.update(member.split("/", 1)[1].encode() + archive.read(member))
        elif name.endswith(".safetensors"):
            size = int.from_bytes(data[:8], "little")
            sha.update(json.dumps(json.loads(data[8 : 8 + size]), sort_keys=True).encode() + data[8 + size :])
        else:
            sha.update(data)
        found[name] = sha.hexdigest()
    return found


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 6-step run that saves at steps 2 and 4 (and 6): its losses, and each save's arguments, to
    save them again (`replay`); folders "A" (step 2) and "B" (step 4) as those saves wrote them."""
    root = tmp_path_factory.mktemp("atomic")
    (root / "corpus").mkdir()
    corpus = write_corpus(root / "corpus", docs=4, words=300)
    cfg = TrainConfig(
        preset="gpt2-tiny",
        model_overrides={"hidden_size": 16},
        data=str(corpus),
        tokenizer="byte",
        seq_len=16,
        batch_size=2,
        max_steps=6,
        warmup_steps=2,
        eval_every=3,
        eval_tokens=64,
        final_eval_tokens=128,
        checkpoint_every=2,
        out=str(root / "full"),
        val_fraction=0.2,
        threads=1,
        device="cpu",
    )
    saves = {}
    real = checkpointer.save_training_checkpoint

    def capture(out, model, optimizer, tokenizer, cfg, step, max_steps, generator, history, **kw):
        saves[step] = dict(
            model=model,
            tokenizer=tokenizer,
            cfg=cfg,
            step=step,
            max_steps=max_steps,
            data_rng=generator.get_state(),
            torch_rng=torch.get_rng_state(),
            history=copy.deepcopy(history),
            weights=copy.deepcopy(kw["weights"]),
            optimizer_state=copy.deepcopy(kw["optimizer_state"]),
        )
        real(out, model, optimizer, tokenizer, cfg, step, max_steps, generator, history, **kw)

    checkpointer.save_training_checkpoint = capture
    try:
        full = train(cfg, progress=False)
    finally:
        checkpointer.save_training_checkpoint = real
    for name, step in (("A", 2), ("B", 4)):
        replay(saves[step], root / name)
    return {"full": full, "saves": saves, "root": root}


def replay(save: dict, out: Path) -> None:
    """save_training_checkpoint again, with what it was given at that step."""
    torch.set_rng_state(save["torch_rng"])
    generator = torch.Generator()
    generator.set_state(save["data_rng"])
    ckpt_module.save_training_checkpoint(
        out,
        save["model"],
        None,
        save["tokenizer"],
        save["cfg"],
        save["step"],
        save["max_steps"],
        generator,
        save["history"],
        weights=save["weights"],
        optimizer_state=save["optimizer_state"],
    )


def left_over(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp") or p.name == JOURNAL)


def test_a_save_replayed_writes_the_same_bytes(run, tmp_path):
    replay(run["saves"][4], tmp_path / "again")
    assert digests(tmp_path / "again") == digests(run["root"] / "B")


@pytest.mark.parametrize("mode", ["error", "death"])
def test_a_save_stopped_at_any_file_operation_leaves_one_whole_checkpoint(run, tmp_path, monkeypatch, mode):
    root = run["root"]
    previous, new = digests(root / "A"), digests(root / "B")
    png = (root / "B" / "loss.png").read_bytes()  # the plot as drawn (matplotlib takes most of a save's time)
    monkeypatch.setattr(ckpt_module, "plot_history", lambda history, path, title: Path(path).write_bytes(png))
    counted = Faults()
    shutil.copytree(root / "A", tmp_path / "count")
    with monkeypatch.context() as patch:
        counted.install(patch)
        replay(run["saves"][4], tmp_path / "count")
    assert digests(tmp_path / "count") == new
    positions = len(counted.ops)
    assert positions >= 30, counted.ops  # 5 writers, their chmod and fsync, renames, journal, manifest
    outcomes = {}
    for at in range(1, positions + 1):
        folder = tmp_path / f"at{at}"
        shutil.copytree(root / "A", folder)
        faults = Faults(at, mode)
        error = None
        with monkeypatch.context() as patch:
            faults.install(patch)
            try:
                replay(run["saves"][4], folder)
            except (Died, CheckpointError) as e:
                error = e
        where = f"{mode} at operation {at} ({counted.ops[at - 1]})"
        if mode == "death":  # the CLI's preflight reads first (k3 train --resume, k3 generate): it recovers too
            if (folder / JOURNAL).exists():  # died after the commit point: kept as left, for the CLI below
                shutil.copytree(folder, tmp_path / f"committed{at}", symlinks=True)
            check_checkpoint(folder)
        state = ckpt_module.load_training_checkpoint(folder)  # the next reader: recovers, checks, loads
        found = digests(folder)
        assert found in (previous, new), where
        assert left_over(folder) == [], where
        outcome = "new" if found == new else "previous"
        assert state["step"] == {"new": 4, "previous": 2}[outcome], where
        if error is None:
            assert outcome == "new", where
        elif isinstance(error, CheckpointError):
            assert ("intact" in str(error)) == (outcome == "previous"), (where, str(error))
        outcomes[at] = outcome
    assert set(outcomes.values()) == {"previous", "new"}
    print(f"{mode}: {positions} positions, {sum(o == 'new' for o in outcomes.values())} ended with the new checkpoint")
    if mode == "error":
        return
    # a save killed after its commit point (its journal and the new files' temporaries left) is read whole by
    # the commands themselves: the first and the last such position, through the CLI's main
    committed = sorted(int(p.name[len("committed") :]) for p in tmp_path.glob("committed*"))
    assert len(committed) >= 5, committed  # the renames, the manifest, the journal's removal
    for at in (committed[0], committed[-1]):
        shutil.copytree(tmp_path / f"committed{at}", tmp_path / f"generate{at}", symlinks=True)
        assert (
            main(
                [
                    "generate",
                    "--checkpoint",
                    str(tmp_path / f"generate{at}"),
                    "--prompt",
                    "the",
                    "--max-new-tokens",
                    "2",
                ]
            )
            == 0
        ), at
        assert main(["train", "--resume", str(tmp_path / f"committed{at}"), "--no-progress"]) == 0, at
        assert left_over(tmp_path / f"committed{at}") == []
        resumed = ckpt_module.load_training_checkpoint(tmp_path / f"committed{at}")["history"]
        assert resumed["loss"] == run["full"]["loss"], at
    # what was left resumes exactly: the last position that kept the previous checkpoint, the first with the new
    last_previous = max(at for at, o in outcomes.items() if o == "previous")
    for at in (last_previous, last_previous + 1):
        resumed = train(TrainConfig(), resume=str(tmp_path / f"at{at}"), progress=False)
        assert resumed["loss"] == run["full"]["loss"] and resumed["val_bpb"] == run["full"]["val_bpb"]


SAVER = textwrap.dedent("""
    import sys, torch
    from k3.training.checkpoint import load_training_checkpoint, save_training_checkpoint
    from k3.training.config import model_config
    from k3.models import CausalLM

    saves = []
    for source in sys.argv[2:]:
        state = load_training_checkpoint(source)
        model = CausalLM(model_config(state["train_config"], state["tokenizer"].vocab_size))
        saves.append(state | {"model_object": model})

    def save(state, out):
        torch.set_rng_state(state["torch_rng"])
        generator = torch.Generator()
        generator.set_state(state["data_rng"])
        save_training_checkpoint(out, state["model_object"], None, state["tokenizer"], state["train_config"],
                                 state["step"], state["max_steps"], generator, state["history"],
                                 weights=state["model"], optimizer_state=state["optimizer"])

    for i, state in enumerate(saves):
        save(state, sys.argv[1] + f".ref{i}")
    save(saves[0], sys.argv[1])  # a checkpoint to start from (a kill during the first save leaves none)
    print("ready", flush=True)
    i = 1
    while True:
        save(saves[i % len(saves)], sys.argv[1])
        i += 1
""")


@pytest.mark.slow  # a real SIGKILL of a saving subprocess, three times
def test_a_save_killed_by_sigkill_leaves_one_whole_checkpoint(run, tmp_path):
    """A process saves the step-2 and step-4 checkpoints in turn into one folder until it is killed
    (SIGKILL) after a random delay; the folder then reads as one of the two, whole."""
    target = tmp_path / "ckpt"
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    delays = random.Random(0)
    found = []
    for attempt in range(3):
        process = subprocess.Popen(
            [sys.executable, str(script), str(target), str(run["root"] / "A"), str(run["root"] / "B")],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        try:
            assert process.stdout.readline().strip() == "ready"
            time.sleep(delays.uniform(0.05, 0.6))
        finally:
            process.send_signal(signal.SIGKILL)
            process.wait()
        references = [digests(Path(f"{target}.ref{i}")) for i in range(2)]
        state = ckpt_module.load_training_checkpoint(target)
        assert digests(target) in references
        assert state["step"] == (2, 4)[references.index(digests(target))]
        assert left_over(target) == []
        found.append(state["step"])
    resumed = train(TrainConfig(), resume=str(target), progress=False)
    assert resumed["loss"] == run["full"]["loss"]
    print(f"SIGKILL: the checkpoint was at steps {found} after the kills")


def test_a_file_replaced_after_the_save_is_refused_by_name(run, tmp_path):
    mixed = tmp_path / "mixed"
    shutil.copytree(run["root"] / "B", mixed)
    shutil.copy(run["root"] / "A" / "trainer_state.pt", mixed / "trainer_state.pt")
    with pytest.raises(CheckpointError, match=r"trainer_state.pt has .* its manifest says .*step 4"):
        ckpt_module.load_training_checkpoint(mixed)
    with pytest.raises(CheckpointError, match=r"trainer_state.pt has"):
        train(TrainConfig(), resume=str(mixed), progress=False)
    # without the manifest (a checkpoint from before it), the files' steps still give the mix away
    (mixed / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=r"different saves \(config.json at step 4, trainer_state.pt at step 2"):
        ckpt_module.load_training_checkpoint(mixed)


def test_model_weights_from_another_step_are_refused_by_from_pretrained(run, tmp_path):
    from k3.models import CausalLM

    mixed = tmp_path / "mixed"
    shutil.copytree(run["root"] / "B", mixed)
    shutil.copy(run["root"] / "A" / "model.safetensors", mixed / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model.safetensors has sha256"):
        CausalLM.from_pretrained(mixed)
    (mixed / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=r"config.json is from step 4 but model.safetensors from step 2"):
        CausalLM.from_pretrained(mixed)
