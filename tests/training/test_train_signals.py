"""k3 train stops on SIGTERM and SIGHUP as on Ctrl-C (k3.training.stop): after the step under way, saved, said,
exit code 128 + the signal; a second signal stops at once without saving, said; one during start-up stops it
at once, said, the folder as it was; under torchrun every process stops after the same step though only
one was signalled."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from k3.cli import main
from k3.training import TrainConfig, loop, stop, train
from k3.training import checkpoint as ckpt_module
from k3.training import step as step_module
from k3.training.stop import Interrupted

from ..corpus import write_corpus
from ..processes import free_port, join, leave
from .test_train_safety import config as safety_config


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"), docs=4, words=300)


def config(corpus, out, **kw) -> TrainConfig:
    """test_train_safety's tiny run, long enough to be signalled mid-way (50 steps, no evaluation)."""
    return safety_config(corpus, out, **{"max_steps": 50, "eval_every": 100, "final_eval_tokens": 0, **kw})


def signal_in_steps(monkeypatch, signals: dict[int, list[int]]) -> None:
    """Raise signals[n] (in order) in this process during its n-th training step's loss."""
    calls = {"n": 0}
    real = step_module.next_token_loss

    def signalled(model, windows, *rest):
        calls["n"] += 1
        for sig in signals.get(calls["n"], []):
            signal.raise_signal(sig)
        return real(model, windows, *rest)

    monkeypatch.setattr(step_module, "next_token_loss", signalled)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_finish_the_step_and_save_as_ctrl_c_does(corpus, tmp_path, monkeypatch, capsys, sig):
    previous = signal.getsignal(sig)
    signal_in_steps(monkeypatch, {3: [sig]})
    with pytest.raises(Interrupted) as stopped:
        train(config(corpus, tmp_path / "run"), progress=False)
    assert stopped.value.signum == sig and stopped.value.said
    assert ckpt_module.load_training_checkpoint(tmp_path / "run")["step"] == 3
    err = capsys.readouterr().err
    name = signal.Signals(sig).name
    assert f"{name}: stopping after this step and saving a checkpoint (send {name} again" in err, err
    assert f"interrupted ({name}) at step 3; checkpoint saved" in err and f"--resume {tmp_path / 'run'}" in err
    assert signal.getsignal(sig) is previous  # the handlers are the run's only


def test_the_cli_exits_with_128_plus_the_signal(corpus, tmp_path, monkeypatch, capsys):
    signal_in_steps(monkeypatch, {2: [signal.SIGTERM]})
    argv = ["train", "--preset", "gpt2-tiny", "--hidden-size", "16", "--data", str(corpus), "--tokenizer", "byte"]
    argv += ["--seq-len", "16", "--batch-size", "2", "--max-steps", "50", "--out", str(tmp_path / "run")]
    assert main([*argv, "--no-progress", "--final-eval-tokens", "0", "--threads", "1"]) == 128 + signal.SIGTERM
    assert ckpt_module.load_training_checkpoint(tmp_path / "run")["step"] == 2
    assert "interrupted (SIGTERM) at step 2; checkpoint saved" in capsys.readouterr().err


def test_a_repeat_within_a_moment_is_the_same_request(corpus, tmp_path, monkeypatch):
    """torchrun forwards the SIGINT or SIGTERM its workers may have had already: not a second press."""
    signal_in_steps(monkeypatch, {2: [signal.SIGTERM, signal.SIGTERM]})
    with pytest.raises(Interrupted):
        train(config(corpus, tmp_path / "run"), progress=False)
    assert ckpt_module.load_training_checkpoint(tmp_path / "run")["step"] == 2


def test_a_second_signal_stops_a_step_at_once_without_saving(corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(stop, "REPEAT_SECONDS", 0.0)
    signal_in_steps(monkeypatch, {2: [signal.SIGINT, signal.SIGINT]})
    with pytest.raises(Interrupted) as stopped:
        train(config(corpus, tmp_path / "run"), progress=False)
    assert stopped.value.signum == signal.SIGINT and stopped.value.said
    assert not ckpt_module.holds_checkpoint(tmp_path / "run")
    err = capsys.readouterr().err
    assert "stopped at once in step 2, without saving" in err and "no checkpoint if the run had saved none" in err


def test_a_second_signal_during_the_save_abandons_it_and_says_the_folder_is_whole(
    corpus, tmp_path, monkeypatch, capsys
):
    run = tmp_path / "run"
    train(config(corpus, run, max_steps=2), progress=False)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != "metrics.jsonl"}
    monkeypatch.setattr(stop, "REPEAT_SECONDS", 0.0)
    signal_in_steps(monkeypatch, {1: [signal.SIGTERM]})
    real = ckpt_module.atomic_write_files

    def pressed_again(folder, writers, **kw):
        def tokenizer_then_signal(path, write=writers["tokenizer.json"]):
            write(path)
            signal.raise_signal(signal.SIGTERM)

        return real(folder, {**writers, "tokenizer.json": tokenizer_then_signal}, **kw)

    monkeypatch.setattr(ckpt_module, "atomic_write_files", pressed_again)
    with pytest.raises(Interrupted) as stopped:
        train(TrainConfig(max_steps=50), resume=str(run), progress=False)
    assert stopped.value.said and stopped.value.signum == signal.SIGTERM
    assert f"stopped at once in the save of step 3, without saving; {run} holds what its last save wrote, whole" in (
        capsys.readouterr().err
    )
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.name in before} == before  # step 2's, whole
    assert ckpt_module.load_training_checkpoint(run)["step"] == 2


def test_a_signal_while_starting_stops_at_once_and_leaves_the_folder(corpus, tmp_path, monkeypatch, capsys):
    def signalled(*args, **kwargs):
        signal.raise_signal(signal.SIGTERM)
        raise AssertionError("not stopped")

    monkeypatch.setattr(loop, "prepare_data", signalled)
    argv = ["train", "--data", str(corpus), "--tokenizer", "byte", "--out", str(tmp_path / "new" / "run")]
    assert main([*argv, "--no-progress"]) == 128 + signal.SIGTERM
    err = capsys.readouterr().err.strip()
    assert err == (
        f"k3 train: SIGTERM while starting, before the first step: stopped; nothing was trained or saved, and "
        f"--out {tmp_path / 'new' / 'run'} is as it was"
    )
    assert not (tmp_path / "new").exists()


# -- under torchrun: two gloo processes, only rank 1 signalled -----------------------------------------------
def _worker(rank: int, port: int, corpus: str, out: str) -> None:
    join(rank, 2, port)
    real = step_module.next_token_loss
    calls = {"n": 0}

    def signalled(model, windows, *rest):
        calls["n"] += 1
        if rank == 1 and calls["n"] == 3:
            signal.raise_signal(signal.SIGTERM)
        return real(model, windows, *rest)

    step_module.next_token_loss = signalled
    try:
        train(config(corpus, out), progress=False, parallel="ddp")
        result = "not stopped"
    except Interrupted as e:
        result = (e.signum, e.said)
    torch.save(result, f"{out}.rank{rank}")
    leave()


@pytest.mark.slow
def test_under_torchrun_every_process_stops_after_the_same_step(corpus, tmp_path):
    out = str(tmp_path / "run")
    torch.multiprocessing.spawn(_worker, args=(free_port(), str(corpus), out), nprocs=2)
    results = [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(2)]
    assert results[1] == (signal.SIGTERM, True) and results[0][1] is True, results
    assert ckpt_module.load_training_checkpoint(Path(out))["step"] == 3
    assert not os.path.exists(Path(out) / ".k3-train.lock")
