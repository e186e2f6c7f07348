"""A new run never destroys what is in its --out: a folder holding a k3 checkpoint (of this model or
another) is refused unless --overwrite is typed, and a file that k3 did not write is never replaced,
even with --overwrite; both refusals come before any work, from Python's `train` and from every process
of a torchrun launch as from `k3 train`. A resumed run writes on in its own folder; into another --out
it is a new run's folder and checked as one."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from k3.cli import main
from k3.training import ParallelDims, TrainConfig, loop, train
from k3.training.checkpoint import OutputFolderError
from k3.training.metrics import read_metrics

from ..commands import fails
from ..corpus import write_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"), docs=4, words=300)


def flags(corpus, out, *more: str) -> list[str]:
    return [
        "train",
        "--preset",
        "gpt2-tiny",
        "--hidden-size",
        "16",
        "--data",
        str(corpus),
        "--tokenizer",
        "byte",
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--max-steps",
        "1",
        "--eval-tokens",
        "64",
        "--final-eval-tokens",
        "64",
        "--threads",
        "1",
        "--device",
        "cpu",
        "--no-progress",
        "--out",
        str(out),
        *more,
    ]


@pytest.fixture(scope="module")
def checkpoint(corpus, tmp_path_factory):
    """A 1-step run's checkpoint folder, written by `k3 train`."""
    out = tmp_path_factory.mktemp("run") / "ckpt"
    assert main(flags(corpus, out)) == 0
    return out


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def no_work(*args, **kwargs):
    raise AssertionError("the run started before its output folder was checked")


def test_a_new_run_into_a_checkpoint_is_refused_with_the_ways_on(corpus, checkpoint, capsys, monkeypatch):
    before = digests(checkpoint)
    monkeypatch.setattr(loop, "prepare_data", no_work)
    # of the same model, and of another one (kimi-k3-tiny into a gpt2-tiny run's folder)
    for more in ((), ("--preset", "kimi-k3-tiny")):
        err = fails(
            capsys,
            flags(corpus, checkpoint, *more),
            f"--out {checkpoint} holds the k3 checkpoint",
            "(at step 1)",
            f"--resume {checkpoint}",
            "another --out",
            "--overwrite",
        )
        assert "Traceback" not in err
    assert digests(checkpoint) == before


def test_overwrite_replaces_a_checkpoint(corpus, checkpoint, tmp_path, capsys):
    import shutil

    out = tmp_path / "again"
    shutil.copytree(checkpoint, out)
    (out / "notes.txt").write_text("the user's")
    assert main(flags(corpus, out, "--overwrite", "--seed", "1")) == 0
    saved = (out / "config.json").read_text()
    assert '"seed": 1' in saved and '"overwrite": true' in saved
    assert (out / "notes.txt").read_text() == "the user's"
    # the saved run's overwrite is not the next command's: a plain new run is refused again
    fails(capsys, flags(corpus, out), "holds the k3 checkpoint")


def test_the_python_api_and_every_torchrun_process_check_before_any_work(corpus, checkpoint, monkeypatch):
    cfg = TrainConfig(preset="gpt2-tiny", data=str(corpus), tokenizer="byte", out=str(checkpoint))
    monkeypatch.setattr(loop, "parallel_dims", no_work)  # a torchrun launch starts its process group there
    for parallel in ("none", "fsdp", "ddp"):
        with pytest.raises(OutputFolderError, match="holds the k3 checkpoint of another run"):
            train(cfg, progress=False, parallel=parallel)
    with pytest.raises(ValueError, match=r"`overwrite` must be True or False, got 'yes'"):
        TrainConfig(overwrite="yes")


def test_files_that_k3_did_not_write_are_never_replaced(corpus, tmp_path, capsys, monkeypatch):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "loss.png").write_bytes(b"the user's own plot")
    (mine / "config.json").write_text('{"mine": true}')
    (mine / "notes.txt").write_text("kept")
    before = digests(mine)
    monkeypatch.setattr(loop, "prepare_data", no_work)
    for more in ((), ("--overwrite",)):
        fails(
            capsys,
            flags(corpus, mine, *more),
            f"--out {mine} holds config.json, loss.png, which k3 did not write",
            "move them or train into another --out",
        )
    assert digests(mine) == before
    monkeypatch.undo()
    # a folder of other files whose names a run does not write takes the run beside them
    (mine / "loss.png").unlink()
    (mine / "config.json").unlink()
    assert main(flags(corpus, mine)) == 0
    assert (mine / "notes.txt").read_text() == "kept" and (mine / "model.safetensors").is_file()


def test_the_log_of_a_run_killed_before_its_first_save_is_k3s_and_said_so(corpus, tmp_path, capsys, monkeypatch):
    """A kill before the first save leaves metrics.jsonl (and the lock): a new run replaces it with --overwrite,
    and --resume says there is nothing to resume; a metrics.jsonl that k3 did not write stays refused."""
    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / "metrics.jsonl").write_text('{"step": 1, "loss": 5.5}\n{"step": 2, "loss": 5.1}\n{"step": 3, "lo')
    (killed / ".k3-train.lock").write_text("12345\n")
    monkeypatch.setattr(loop, "prepare_data", no_work)
    fails(
        capsys,
        flags(corpus, killed),
        f"--out {killed} holds the metrics.jsonl of a k3 run that stopped before its first checkpoint (2 steps "
        f"logged, nothing saved, so nothing to resume); give --overwrite",
    )
    fails(
        capsys,
        ["train", "--resume", str(killed)],
        f"--resume {killed}: the run there stopped before its first checkpoint (2 steps logged in metrics.jsonl, "
        f"nothing saved), so there is nothing to resume; start it again with --out {killed} --overwrite",
    )
    with pytest.raises(FileNotFoundError, match="nothing to resume"):
        train(TrainConfig(), resume=str(killed), progress=False)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "metrics.jsonl").write_text("step,loss\n1,5.5\n")
    fails(capsys, flags(corpus, theirs, "--overwrite"), "holds metrics.jsonl, which k3 did not write")
    monkeypatch.undo()
    assert main(flags(corpus, killed, "--overwrite")) == 0
    assert [r["step"] for r in read_metrics(killed / "metrics.jsonl")] == [1, 1]  # (the final evaluation's line)


def test_a_resumed_run_into_another_out_is_checked_as_a_new_runs_folder(corpus, checkpoint, tmp_path, capsys):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(checkpoint, other)
    before = digests(other)
    fails(
        capsys,
        ["train", "--resume", str(checkpoint), "--max-steps", "2", "--out", str(other), "--no-progress"],
        f"--out {other} holds the k3 checkpoint",
    )
    assert digests(other) == before
    # in its own folder (however the path is written) a resumed run writes on
    own = tmp_path / "own"
    shutil.copytree(checkpoint, own)
    assert main(["train", "--resume", str(own) + "/", "--max-steps", "2", "--no-progress"]) == 0
    assert '"step": 2' in (own / "config.json").read_text()


def test_a_checkpoint_saved_with_fsdp_ep_resumes_in_one_process_with_the_plain_command(
    corpus, tmp_path, capsys, monkeypatch
):
    """The saved layout (`ep` 2 of --parallel fsdp) adapts to the launch: the plain `k3 train --resume DIR`
    in one process trains on with ep 1; only an explicit --ep that the launch contradicts is refused."""
    out = tmp_path / "fsdp-ep2"
    with monkeypatch.context() as patch:  # a checkpoint whose saved TrainConfig says ep 2 (as fsdp x ep 2 saves)
        patch.setattr(loop, "parallel_dims", lambda *args: ParallelDims())
        train(
            TrainConfig(
                preset="gpt2-tiny",
                model_overrides={"hidden_size": 16},
                data=str(corpus),
                tokenizer="byte",
                seq_len=16,
                batch_size=2,
                max_steps=1,
                eval_tokens=64,
                final_eval_tokens=64,
                threads=1,
                device="cpu",
                ep=2,
                out=str(out),
            ),
            progress=False,
        )
    assert '"ep": 2' in (out / "config.json").read_text()
    fails(
        capsys,
        ["train", "--resume", str(out), "--max-steps", "2", "--ep", "2", "--no-progress"],
        "--ep 2 is for --parallel fsdp",
    )
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--max-steps", "2", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "trained with --ep 2 (--parallel fsdp); this launch (--parallel none, 1 process) trains on with ep 1" in err
    assert '"step": 2' in (out / "config.json").read_text()
