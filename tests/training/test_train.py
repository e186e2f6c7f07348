"""k3 train / k3 generate on a tiny local corpus: exact resume, checkpoint contents, failures that
lose nothing, Ctrl-C, the schedule and the weight-decay groups."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import importlib
import json
import signal

import pytest
import torch

from k3.cli import main
from k3.io import MANIFEST
from k3.models import CausalLM, get_config
from k3.training import TrainConfig, build_optimizer, learning_rate, loop, no_decay, train
from k3.training import checkpoint as ckpt_module
from k3.training import step as step_module
from k3.training.checkpoint import CheckpointError

from ..corpus import write_corpus

TINY = {"hidden_size": 32, "vocab_size": 0}  # vocab_size is set from the tokenizer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"), docs=6, words=700)


def config(corpus, out, **kw) -> TrainConfig:
    base = dict(
        preset="kimi-k3-tiny",
        model_overrides={"hidden_size": 32},
        data=str(corpus),
        tokenizer="byte",
        seq_len=32,
        batch_size=2,
        max_steps=6,
        warmup_steps=2,
        eval_every=3,
        eval_tokens=256,
        final_eval_tokens=512,
        out=str(out),
        val_fraction=0.2,
        device="cpu",
    )
    return TrainConfig(**{**base, **kw})


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_resume_gives_the_uninterrupted_loss_sequence(corpus, tmp_path):
    full = train(config(corpus, tmp_path / "full"), progress=False)
    train(config(corpus, tmp_path / "half", max_steps=3), progress=False)
    resumed = train(TrainConfig(max_steps=6), resume=str(tmp_path / "half"), progress=False)
    assert len(full["loss"]) == 6 and resumed["loss"] == full["loss"]
    assert resumed["val_bpb"] == full["val_bpb"]


def test_checkpoint_holds_everything_and_loads(corpus, tmp_path):
    train(config(corpus, tmp_path, max_steps=2), progress=False)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        ".k3-manifest.json",
        "config.json",
        "loss.png",
        "metrics.jsonl",
        "model.safetensors",
        "tokenizer.json",
        "trainer_state.pt",
    ]
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    model = CausalLM.from_pretrained(tmp_path)
    assert model.config.hidden_size == 32 and model.config.vocab_size == 257


def test_a_failed_save_leaves_the_previous_checkpoint(corpus, tmp_path, monkeypatch):
    train(config(corpus, tmp_path, max_steps=2), progress=False)
    before = {p.name: digest(p) for p in tmp_path.iterdir()}

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointError, match="No space left on device; the previous checkpoint .* is intact"):
        train(TrainConfig(max_steps=4), resume=str(tmp_path), progress=False)
    after = {p.name: digest(p) for p in tmp_path.iterdir()}
    assert after.keys() == before.keys()  # no temp files
    # nothing of the checkpoint changed (the metrics log, beside it, has the lines of the steps run)
    assert {n: d for n, d in after.items() if n != "metrics.jsonl"} == {
        n: d for n, d in before.items() if n != "metrics.jsonl"
    }
    monkeypatch.undo()
    assert ckpt_module.load_training_checkpoint(tmp_path)["step"] == 2


def test_ctrl_c_finishes_the_step_saves_and_resumes_exactly(corpus, tmp_path, monkeypatch, capsys):
    """Ctrl-C during step 4: the step completes, a checkpoint is saved, the resume command printed,
    and resuming gives the uninterrupted loss sequence."""
    calls = {"n": 0}
    real = step_module.next_token_loss

    def interrupted(model, windows, *rest):
        calls["n"] += 1
        if calls["n"] == 4:
            signal.raise_signal(signal.SIGINT)
        return real(model, windows, *rest)

    monkeypatch.setattr(step_module, "next_token_loss", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(config(corpus, tmp_path / "run"), progress=False)
    monkeypatch.undo()
    assert ckpt_module.load_training_checkpoint(tmp_path / "run")["step"] == 4
    assert f"k3 train --resume {tmp_path / 'run'}" in capsys.readouterr().err
    resumed = train(TrainConfig(), resume=str(tmp_path / "run"), progress=False)
    assert resumed["loss"] == train(config(corpus, tmp_path / "full"), progress=False)["loss"]


def test_resume_with_another_model_names_the_setting(corpus, tmp_path):
    train(config(corpus, tmp_path, max_steps=1, warmup_steps=1), progress=False)
    wider = TrainConfig(max_steps=2, preset="kimi-k3-tiny", model_overrides={"hidden_size": 48})
    with pytest.raises(
        ValueError, match="`model_overrides` {'hidden_size': 48} \\(the checkpoint's: {'hidden_size': 32}\\)"
    ):
        train(wider, resume=str(tmp_path), progress=False)


def test_schedule_shapes():
    cfg = TrainConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=10, schedule="cosine")
    assert learning_rate(cfg, 0, 100) == pytest.approx(0.1) and learning_rate(cfg, 9, 100) == pytest.approx(1.0)
    assert learning_rate(cfg, 99, 100) == pytest.approx(0.1, abs=1e-3)
    assert 0.1 < learning_rate(cfg, 50, 100) < 1.0  # cosine: already decaying half way
    wsd = TrainConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=10, schedule="wsd", wsd_decay_fraction=0.2)
    assert learning_rate(wsd, 50, 100) == 1.0 and learning_rate(wsd, 99, 100) == pytest.approx(0.1)
    assert 0.1 < learning_rate(wsd, 90, 100) < 1.0


def test_weight_decay_spares_norms_gates_and_queries():
    model = CausalLM(get_config("kimi-k3-tiny", vocab_size=64))
    spared = {n for n, p in model.named_parameters() if no_decay(n, p)}
    assert "model.layers.0.self_attn.A_log" in spared and "model.layers.0.self_attn.dt_bias" in spared
    assert "model.layers.0.attn_res.proj.weight" in spared and "model.norm.weight" in spared
    assert "model.layers.0.self_attn.q_proj.weight" not in spared
    assert "model.layers.1.block_sparse_moe.experts.0.w1" not in spared


def test_cli_train_then_generate(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--data",
                str(corpus),
                "--tokenizer",
                "byte",
                "--hidden-size",
                "32",
                "--seq-len",
                "32",
                "--batch-size",
                "2",
                "--max-steps",
                "2",
                "--eval-every",
                "2",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    assert main(["generate", "--checkpoint", str(out), "--prompt", "to be", "--max-new-tokens", "5"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("to be") and "tokens/s" in captured.err
    assert main(["generate", "--checkpoint", str(out), "--prompt", ""]) == 2
    assert "empty after tokenization" in capsys.readouterr().err
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("to be\n\nwhat light through yonder\nO\n")
    assert (
        main(
            [
                "generate",
                "--checkpoint",
                str(out),
                "--prompt-file",
                str(prompts),
                "--max-new-tokens",
                "4",
                "--temperature",
                "0",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    blocks = captured.out.split("--- prompt ")[1:]
    texts = ["to be", "what light through yonder", "O"]
    assert [b.split("\n", 1)[1].startswith(t) for b, t in zip(blocks, texts)] == [True] * 3
    assert len(blocks) == 3 and "3 prompts" in captured.err
    alone = []
    for text in texts:
        assert (
            main(
                ["generate", "--checkpoint", str(out), "--prompt", text, "--max-new-tokens", "4", "--temperature", "0"]
            )
            == 0
        )
        alone.append(capsys.readouterr().out.rstrip("\n"))
    # each line as if alone (greedy; streaming holds back a last incomplete character)
    assert all(b.split("\n", 1)[1].startswith(a) for b, a in zip(blocks, alone))
    assert main(["generate", "--checkpoint", str(out), "--prompt-file", str(tmp_path / "none.txt")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["train", "--preset", "gpt5", "--max-steps", "1"]) == 2
    assert "unknown preset 'gpt5'; choose from" in capsys.readouterr().err
    assert main(["train", "--data", str(tmp_path / "nothing"), "--max-steps", "1", "--out", str(tmp_path / "x")]) == 2
    assert "no such file or folder" in capsys.readouterr().err


def test_time_budget_fixes_the_step_count_and_keeps_it(corpus, tmp_path):
    """With a time budget, the step count is fixed after timing a few steps (evaluations included)
    and stored, so a resumed run follows the same schedule."""
    cfg = config(corpus, tmp_path, max_steps=None, time_budget=0.1, calibration_steps=2)
    history = train(cfg, progress=False)
    state = ckpt_module.load_training_checkpoint(tmp_path)
    steps = state["max_steps"]
    assert steps is not None and steps >= 5 and history["step"][-1] == steps
    assert history["seconds"] < 0.1 * 60 * 1.5 + 5  # stays near the budget
    assert loop._steps_in_budget(cfg, 4, 1.0, 0.1) > loop._steps_in_budget(cfg, 4, 1.0, 0.2)


def test_a_time_budget_run_follows_the_machine_speed():
    class Bar:
        total = 1000

        def write(self, *args, **kwargs):
            pass

    cfg = TrainConfig(
        max_steps=None, time_budget=2.0, eval_every=100, eval_tokens=4096, final_eval_tokens=4096, warmup_steps=5
    )
    # after 100 s at 10 s/step about a dozen of the planned 1000 fit in the 20 s left
    assert 10 < loop._replan(cfg, 10, 100.0, 10.0, 1000, Bar()) < 20
    # a machine that keeps the planned speed keeps the plan (within 3%)
    planned = loop._steps_in_budget(cfg, 10, 1.0, 0.1)
    assert loop._replan(cfg, 10, 1.0, 0.1, planned, Bar()) == planned
    assert loop._replan(cfg, 10, 1.0, 0.1, int(planned * 0.98), Bar()) == int(planned * 0.98)
    # one that sped up lengthens it, to what now fits
    assert loop._replan(cfg, 10, 1.0, 0.1, planned // 2, Bar()) == planned
    # within the warm-up the plan follows every estimate
    warm = dataclasses.replace(cfg, warmup_steps=50)
    assert loop._replan(warm, 10, 1.0, 0.1, int(planned * 0.99), Bar()) == planned


def test_compile_compiles_the_decoder_and_needs_a_cxx_compiler(corpus, tmp_path, monkeypatch, capsys):
    """--compile reaches nn.Module.compile on the decoder (compiling itself takes minutes: not run here);
    without a C++ compiler it stops at once with a message that says what to do."""
    from k3 import runtime

    parallelize_module = importlib.import_module("k3.training.parallel.parallelize")

    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **k: compiled.append(type(self).__name__))
    train(config(corpus, tmp_path / "c", max_steps=1, warmup_steps=1, compile=True), progress=False)
    assert compiled == ["Decoder"]
    monkeypatch.setattr(runtime.shutil, "which", lambda name: None)
    monkeypatch.setattr(parallelize_module, "cxx_compiler", runtime.cxx_compiler)
    with pytest.raises(ValueError, match="no C\\+\\+ compiler was found"):
        train(config(corpus, tmp_path / "d", max_steps=1, warmup_steps=1, compile=True), progress=False)
    assert (
        main(
            [
                "train",
                "--data",
                str(corpus),
                "--tokenizer",
                "byte",
                "--hidden-size",
                "32",
                "--max-steps",
                "1",
                "--compile",
                "--out",
                str(tmp_path / "e"),
                "--no-progress",
            ]
        )
        == 2
    )
    assert "install one" in capsys.readouterr().err


@pytest.mark.slow
def test_a_compiled_run_trains_to_its_end_as_eager_does(corpus, tmp_path, monkeypatch):
    """`compile=True` compiles the decoder as one graph (fullgraph) and runs to the end: evaluations of
    other batch shapes (every step, and the final one) run it eager instead of recompiling, and the
    losses and validation equal an eager run's. ("aot_eager" traces what inductor would, without C++.)"""
    compile_module = torch.nn.Module.compile
    calls = []

    def traced(self, *args, **kwargs):
        calls.append(kwargs)
        compile_module(self, *args, **{**kwargs, "backend": "aot_eager"})

    eager = train(config(corpus, tmp_path / "eager", max_steps=3, eval_every=1), progress=False)
    torch._dynamo.reset()
    monkeypatch.setattr(torch.nn.Module, "compile", traced)
    compiled = train(config(corpus, tmp_path / "compiled", max_steps=3, eval_every=1, compile=True), progress=False)
    assert calls == [{"fullgraph": True}]
    for key in ("loss", "val_bpb"):
        assert len(compiled[key]) == len(eager[key]) > 0
        torch.testing.assert_close(torch.tensor(compiled[key]), torch.tensor(eager[key]), rtol=1e-4, atol=1e-4)


def test_checkpoints_record_the_maths_and_a_load_keeps_the_optimizers_implementation():
    from k3.training.optim import load_keeping_implementation, portable_state

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    fused = build_optimizer(model, TrainConfig(optimizer="adamw"))
    assert all(g["fused"] for g in fused.param_groups)  # plain CPU tensors: torch's fused AdamW
    model(torch.randn(2, 4)).sum().backward()
    fused.step()
    saved = portable_state(fused.state_dict())
    assert all("fused" not in g and "foreach" not in g for g in saved["param_groups"])
    plain = torch.optim.AdamW([{"params": g["params"]} for g in fused.param_groups], lr=1.0)
    load_keeping_implementation(plain, lambda: plain.load_state_dict(saved))
    assert plain.param_groups[0]["fused"] is None and plain.param_groups[0]["lr"] == fused.param_groups[0]["lr"]
    load_keeping_implementation(fused, lambda: fused.load_state_dict(saved))
    assert all(g["fused"] for g in fused.param_groups)


def test_a_relative_data_path_resumes_from_another_working_directory(corpus, tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(corpus.parent)
    train(config(corpus, tmp_path / "a" / "run", data=corpus.name, max_steps=2), progress=False)
    run = tmp_path / "a" / "run"
    assert json.loads((run / "config.json").read_text())["train"]["data"] == str(corpus.resolve())
    monkeypatch.chdir(tmp_path / "b")
    assert train(TrainConfig(max_steps=3), resume="../a/run", progress=False)["step"][-1] == 3
    # as k3 wrote a checkpoint before: the path relative to where the run was trained, no corpus fingerprint
    saved = json.loads((run / "config.json").read_text())
    saved["train"]["data"] = corpus.name
    (run / "config.json").write_text(json.dumps(saved))
    state = torch.load(run / "trainer_state.pt", weights_only=True)
    torch.save({k: v for k, v in state.items() if k != "corpus"}, run / "trainer_state.pt")
    (run / MANIFEST).unlink()  # (an older save's files, as they are)
    with pytest.raises(ValueError, match=f"its --data '{corpus.name}'\\) is a path relative to the folder it was"):
        train(TrainConfig(max_steps=4), resume="../a/run", progress=False)


def test_a_resume_reads_the_corpus_it_trained_on_wherever_it_is_now(tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_text(" ".join(f"word{i % 97}" for i in range(4000)))
    train(config(data, tmp_path / "run", max_steps=2), progress=False)
    kept = data.read_text()
    data.write_text(kept[: len(kept) // 2])  # edited in place: other tokens
    with pytest.raises(ValueError, match=f"--data {data} is not the corpus the run trained on"):
        train(TrainConfig(max_steps=3), resume=str(tmp_path / "run"), progress=False)
    moved = tmp_path / "moved.txt"
    moved.write_text(kept)
    data.unlink()
    with pytest.raises(ValueError, match=f"the checkpoint's corpus {data} is not there; give --data with where"):
        train(TrainConfig(max_steps=3), resume=str(tmp_path / "run"), progress=False)
    resumed = train(TrainConfig(max_steps=3, data=str(moved)), resume=str(tmp_path / "run"), progress=False)
    assert resumed["step"][-1] == 3
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["data"] == str(moved)
