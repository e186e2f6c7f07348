"""k3 train's trainer flags: --grad-accum (the step of an N times larger batch), --precision bf16
(float32 weights, AdamW states and linear-attention states), --device, --final-eval-tokens,
metrics.jsonl (continued on resume) and --log tensorboard|wandb.

Tolerances: grad-accum against one larger batch differs only in the order of float32 sums: losses
within 1e-5 relative, weights within 5% of one learning rate entrywise (measured: 1.9e-5 = 0.6% of lr
after 3 steps). bf16 autocast against float32: loss within 2% (bfloat16 keeps 8 bits of mantissa).
"""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from safetensors.torch import load_file

from k3.cli import main
from k3.models import CausalLM, get_config
from k3.ops import chunk_delta_rule, chunk_gated_delta_rule, chunk_kda, chunk_linear_attn
from k3.training import TrainConfig, build_optimizer, train, training_step
from k3.training.loop import _resume_overrides
from k3.training.metrics import METRICS_FILE, MetricsLog, read_metrics

from ..corpus import write_corpus

LR = 3e-3


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
        max_steps=3,
        warmup_steps=1,
        eval_every=3,
        eval_tokens=256,
        final_eval_tokens=256,
        out=str(out),
        val_fraction=0.2,
        moe_bias_rate=1e-2,
        lr=LR,
        device="cpu",
    )
    return TrainConfig(**{**base, **kw})


def test_grad_accum_takes_the_step_of_a_larger_batch(corpus, tmp_path):
    """2 micro-batches of 2 = one batch of 4: same losses, validation, weights and MoE biases (which a
    bias update per micro-batch would move twice: 1e-2 apart), one optimizer step per step."""
    accumulated = train(config(corpus, tmp_path / "accum", grad_accum=2), progress=False)
    whole = train(config(corpus, tmp_path / "whole", batch_size=4), progress=False)
    assert accumulated["step"] == whole["step"] == [1, 2, 3]
    assert accumulated["tokens"] == whole["tokens"] == 3 * 4 * 32
    assert accumulated["loss"] == pytest.approx(whole["loss"], rel=1e-5)
    assert accumulated["val_bpb"] == pytest.approx(whole["val_bpb"], rel=1e-5)
    a, b = (load_file(tmp_path / run / "model.safetensors") for run in ("accum", "whole"))
    assert a.keys() == b.keys()
    for name in a:
        assert float((a[name] - b[name]).abs().max()) <= 0.05 * LR, name
    # AdamW stepped 3 times (an expert that no token chose in a step has no gradient then, in both runs;
    # Muon's matrices keep a momentum and no count)
    steps = [
        [
            float(s["step"])
            for s in torch.load(tmp_path / run / "trainer_state.pt", weights_only=True)["optimizer"]["state"].values()
            if "step" in s
        ]
        for run in ("accum", "whole")
    ]
    assert steps[0] and steps[0] == steps[1] and max(steps[0]) == 3.0


def test_bf16_trains_float32_weights_and_states_close_to_float32(corpus):
    torch.manual_seed(0)
    model = CausalLM(get_config("kimi-k3-tiny", hidden_size=32, vocab_size=64))
    fp32 = CausalLM(model.config)
    fp32.load_state_dict(model.state_dict())
    windows = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(1))
    cfg = TrainConfig(precision="bf16")
    low = training_step(model, build_optimizer(model, cfg), windows, cfg)
    optimizer = build_optimizer(model, cfg)
    training_step(model, optimizer, windows, cfg)
    high = training_step(fp32, build_optimizer(fp32, TrainConfig()), windows, TrainConfig())
    assert low == pytest.approx(high, rel=2e-2) and low != high  # bf16 did run
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in model.parameters() if p.grad is not None} == {torch.float32}
    moments = [t for s in optimizer.state.values() for k, t in s.items() if k != "step"]
    assert moments and {t.dtype for t in moments} == {torch.float32}


@pytest.mark.parametrize(
    "op,gate",
    [(chunk_delta_rule, None), (chunk_gated_delta_rule, "head"), (chunk_kda, "channel"), (chunk_linear_attn, "linear")],
)
def test_linear_attention_ops_keep_float32_under_autocast(op, gate):
    """Under bf16 autocast the ops' matmuls and states stay float32: the same outputs and state as
    without autocast (autocast would otherwise run the chunk matmuls in bfloat16)."""
    g = torch.Generator().manual_seed(0)
    B, T, H, K = 1, 37, 2, 16
    q, k, v = (torch.randn(B, T, H, K, generator=g) for _ in range(3))
    if gate == "linear":
        args, kwargs = (q, k, v), dict(output_final_state=True, chunk_size=16)
    else:
        beta = torch.rand(B, T, H, generator=g)
        decay = {
            None: (),
            "head": (-torch.rand(B, T, H, generator=g),),
            "channel": (-torch.rand(B, T, H, K, generator=g),),
        }[gate]
        args, kwargs = (q, k, v, *decay, beta), dict(output_final_state=True, use_qk_l2norm=True, chunk_size=16)
    o, state = op(*args, **kwargs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o_auto, state_auto = op(*args, **kwargs)
    states = state if isinstance(state, tuple) else (state,)
    states_auto = state_auto if isinstance(state_auto, tuple) else (state_auto,)
    assert o_auto.dtype == torch.float32 and torch.equal(o_auto, o)
    for s, s_auto in zip(states, states_auto):
        assert s_auto.dtype == torch.float32 and torch.equal(s_auto, s)


def test_metrics_log_has_every_step_and_continues_on_resume(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    train(config(corpus, out, max_steps=2, eval_every=2, threads=1, device="auto"), progress=False)
    header = capsys.readouterr().err.splitlines()[0]
    assert "on cpu (--device auto: CUDA, else MPS, else the CPU)" in header and "float32, 1 CPU thread;" in header
    first = read_metrics(out / METRICS_FILE)
    assert [r["step"] for r in first] == [1, 2, 2]
    assert set(first[0]) == {"step", "loss", "lr", "tokens_per_s", "grad_norm", "max_logit", "qk_clipped_heads"}
    assert set(first[1]) == set(first[0]) | {"val_bpb"} and set(first[2]) == {
        "step",
        "final_val_bpb",
        "final_eval_tokens",
    }
    assert first[0]["lr"] == pytest.approx(LR) and first[0]["grad_norm"] > 0 and first[0]["tokens_per_s"] > 0
    # lines a killed run wrote after its checkpoint (a step it will take again, and a cut line) go;
    # the rest is kept as it was, and the resumed steps follow; no final evaluation with 0 tokens
    with open(out / METRICS_FILE, "a") as f:
        f.write(json.dumps({"step": 3, "loss": 9.0}) + "\n" + '{"step": 4, "lo')
    history = train(TrainConfig(max_steps=3, final_eval_tokens=0), resume=str(out), progress=False)
    records = read_metrics(out / METRICS_FILE)
    assert records[:3] == first and [r["step"] for r in records] == [1, 2, 2, 3]
    assert records[3]["loss"] == pytest.approx(history["loss"][-1]) and "final_val_bpb" not in history
    assert (out / METRICS_FILE).read_text().endswith("}\n")
    assert "no final evaluation" in capsys.readouterr().err
    # k3 generate --device
    assert (
        main(["generate", "--checkpoint", str(out), "--prompt", "to be", "--max-new-tokens", "2", "--device", "cpu"])
        == 0
    )
    assert "on cpu]" in capsys.readouterr().err


def test_cli_flags_reach_the_config_and_a_resume(corpus, tmp_path, monkeypatch):
    from k3.cli import build_parser
    from k3.cli.train import train_config

    args = build_parser().parse_args(
        [
            "train",
            "--device",
            "cpu",
            "--precision",
            "bf16",
            "--grad-accum",
            "3",
            "--eval-tokens",
            "128",
            "--final-eval-tokens",
            "0",
            "--log",
            "none",
        ]
    )
    cfg = train_config(args)
    assert (cfg.device, cfg.precision, cfg.grad_accum, cfg.eval_tokens, cfg.final_eval_tokens, cfg.log) == (
        "cpu",
        "bf16",
        3,
        128,
        0,
        None,
    )
    defaults = train_config(build_parser().parse_args(["train"]))
    assert (defaults.device, defaults.precision, defaults.grad_accum, defaults.final_eval_tokens) == (
        "auto",
        "fp32",
        1,
        TrainConfig().final_eval_tokens,
    )
    saved = TrainConfig(precision="bf16", grad_accum=2, device="cuda", log="wandb")
    # asked by name, the defaults count: back to fp32, the CPU and no logger; the batch may not change
    assert _resume_overrides(TrainConfig(), saved, asked=("precision", "device", "log")) == {
        "precision": "fp32",
        "device": "auto",
        "log": None,
    }
    assert _resume_overrides(TrainConfig(), saved) == {}
    with pytest.raises(ValueError, match="`grad_accum` 1 \\(the checkpoint's: 2\\)"):
        _resume_overrides(TrainConfig(), saved, asked=("grad_accum",))
    # how a launch saves is its own: a run resumed once without --async-checkpoint may save asynchronously again
    again = _resume_overrides(TrainConfig(async_checkpoint=True), TrainConfig(async_checkpoint=False))
    assert again == {"async_checkpoint": True}


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--log", "tensorboard"],
            "--log tensorboard needs the tensorboard package, which is not installed: pip install tensorboard",
        ),
        (["--log", "wandb"], "--log wandb needs the wandb package, which is not installed: pip install wandb"),
        (["--device", "cuda"], "--device cuda: this PyTorch sees no CUDA GPU"),
        (["--device", "mps"], "--device mps: Apple's MPS is not available here"),
        (["--grad-accum", "0"], "argument --grad-accum: expected micro-batches per optimizer step, an integer >= 1"),
    ],
)
def test_what_cannot_run_is_one_line_before_any_work(corpus, tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails, installed or not
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    out = tmp_path / "never"
    code = main(["train", "--data", str(corpus), "--tokenizer", "byte", "--out", str(out), *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_tensorboard_and_wandb_get_the_metrics_lines(tmp_path, monkeypatch):
    """The logger backends, with stand-ins for the packages: the same figures as metrics.jsonl."""
    scalars, logged = [], []

    class SummaryWriter:
        def __init__(self, log_dir):
            self.log_dir = log_dir

        def add_scalar(self, tag, value, step):
            scalars.append((tag, value, step))

        def flush(self):
            pass

        def close(self):
            scalars.append("closed")

    class Run:
        def log(self, figures, step):
            logged.append((figures, step))

        def finish(self):
            logged.append("finished")

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=SummaryWriter))
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: Run()))
    record = {"step": 5, "loss": 2.5, "lr": 1e-3, "tokens_per_s": 100.0, "grad_norm": None, "val_bpb": 1.5}
    for log in ("tensorboard", "wandb"):
        (tmp_path / log).mkdir()
        metrics = MetricsLog(tmp_path / log, 0, log=log)
        metrics.write(record)
        metrics.close()
        assert read_metrics(tmp_path / log / METRICS_FILE) == [record]
    assert scalars == [
        ("train/loss", 2.5, 5),
        ("train/lr", 1e-3, 5),
        ("train/tokens_per_s", 100.0, 5),
        ("val/val_bpb", 1.5, 5),
        "closed",
    ]
    assert logged == [
        ({"train/loss": 2.5, "train/lr": 1e-3, "train/tokens_per_s": 100.0, "val/val_bpb": 1.5}, 5),
        "finished",
    ]


def test_the_head_under_autocast_runs_bf16_matmuls_and_a_float32_softmax():
    from k3.models.loss import head_cross_entropy

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(50, 32, generator=g, requires_grad=True)
    weight = torch.randn(300, 32, generator=g, requires_grad=True)
    targets = torch.randint(0, 300, (50,), generator=g)
    loss = head_cross_entropy(hidden, weight, targets, piece=1000)  # 3 tokens a piece
    grads = torch.autograd.grad(loss, (hidden, weight))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = head_cross_entropy(hidden, weight, targets, piece=1000)
    low_grads = torch.autograd.grad(low, (hidden, weight))
    low, loss = low.detach(), loss.detach()
    assert low.dtype == torch.float32 and float(low) == pytest.approx(float(loss), rel=1e-2) and low != loss
    for a, b in zip(low_grads, grads):
        assert a.dtype == torch.float32 and float((a - b).norm() / b.norm()) < 2e-2
