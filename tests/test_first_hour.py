"""What a new user meets in the first hour (issue 27): nothing lost, nothing silent, every error clear.

A resumed run with nothing left to train touches nothing; a refused run leaves no folder or log behind;
flags that would silently override each other are refused naming both; the Python API's bad inputs are
ValueError / TypeError naming the argument; a custom hybrid is one `get_config` call; short runs leave
their warm-up and decay; `--help` shows the defaults; error messages name the right file and thing."""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys

import pytest
import torch

from k3 import CausalLM, get_config
from k3.cli import main
from k3.cli.parser import build_parser
from k3.training import TrainConfig, train
from k3.training.optim import learning_rate, warmup_steps

from .commands import fails
from .corpus import write_corpus

TINY = dict(
    preset="kimi-k3-tiny",
    model_overrides={"hidden_size": 32, "num_layers": 2},
    tokenizer="byte",
    seq_len=16,
    batch_size=2,
    eval_every=2,
    eval_tokens=64,
    final_eval_tokens=64,
    val_fraction=0.2,
    threads=1,
    device="cpu",
)
TINY_FLAGS = [
    "--tokenizer",
    "byte",
    "--hidden-size",
    "32",
    "--num-layers",
    "2",
    "--seq-len",
    "16",
    "--batch-size",
    "2",
    "--eval-every",
    "2",
    "--eval-tokens",
    "64",
    "--final-eval-tokens",
    "64",
    "--threads",
    "1",
    "--device",
    "cpu",
    "--no-progress",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"), docs=4, words=300)


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """A 3-step run's checkpoint (read-only for the tests: copy it to change it)."""
    out = tmp_path_factory.mktemp("trained") / "run"
    train(TrainConfig(**TINY, data=str(corpus), max_steps=3, out=str(out)), progress=False)
    return out


def snapshot(folder) -> dict:
    """Every file of `folder` with its bytes' sha256 and its modification time."""
    return {
        p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(folder.iterdir())
        if p.is_file()
    }


# -- nothing lost, nothing silent ---------------------------------------------------------------------
def test_a_resume_with_nothing_left_to_train_touches_nothing(trained, tmp_path, capsys):
    run = shutil.copytree(trained, tmp_path / "run")
    before = snapshot(run)
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--max-steps", "3", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "nothing to do" in err and "trained all its 3 steps" in err and "done," not in err
    err = fails(capsys, ["train", "--resume", str(run), "--max-steps", "2", "--no-progress"])
    assert "--max-steps 2: the checkpoint in" in err and "has trained 3 steps already" in err
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0  # its own 3 steps: done already
    assert snapshot(run) == before


def test_a_resume_says_where_it_starts_and_what_this_run_did(trained, tmp_path, capsys):
    run = shutil.copytree(trained, tmp_path / "run")
    capsys.readouterr()
    history = train(TrainConfig(max_steps=5), resume=str(run), asked=("max_steps",), progress=False)
    err = capsys.readouterr().err
    assert f"k3 train: resumed {run} at step 3 of 5" in err
    done = [line for line in err.splitlines() if line.startswith("k3 train: done")][0]
    this_run = history["tokens"] - 3 * 2 * 16
    assert f"this run 2 steps, {this_run:,} tokens" in done and f"in all 5 steps, {history['tokens']:,} tokens" in done


def test_a_refused_run_leaves_nothing_behind(corpus, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "binary.bin").write_bytes(bytes(range(256)) * 8)
    (tmp_path / "tiny.txt").write_text("abc")
    for data in ("missing.txt", "empty", "binary.bin", "tiny.txt"):
        out = tmp_path / "runs" / data / "out"
        fails(capsys, ["train", "--data", str(tmp_path / data), "--out", str(out), "--max-steps", "2", *TINY_FLAGS])
        assert not (tmp_path / "runs").exists(), data
    # a model far too big for memory: refused after the folder was claimed, which is removed again
    out = tmp_path / "big"
    err = fails(
        capsys,
        [
            "train",
            "--data",
            str(corpus),
            "--out",
            str(out),
            "--max-steps",
            "2",
            *TINY_FLAGS,
            "--set",
            "intermediate_size=2000000000",
        ],
    )
    assert "memory" in err and not out.exists()
    # an existing folder keeps what it had: the earlier run's log is not emptied by a refused one
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    fails(capsys, ["train", "--data", str(tmp_path / "tiny.txt"), "--out", str(kept), *TINY_FLAGS])
    assert sorted(p.name for p in kept.iterdir()) == ["metrics.jsonl"]
    assert (kept / "metrics.jsonl").read_text() == '{"step": 1, "loss": 2.0}\n'


def test_plan_refuses_zero_gpus(capsys):
    for gpus in ("0", "-8"):
        err = fails(capsys, ["plan", "kimi-k3", "--train", "--gpus", gpus])
        assert f"--gpus: expected GPUs, an integer in [1, 1,048,576], got '{gpus}'" in err


# -- the Python API's bad inputs ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return CausalLM(get_config("kimi-k3-tiny", vocab_size=300, num_layers=2, hidden_size=32)).eval()


def test_empty_ids_and_out_of_vocabulary_targets_are_named(model):
    with pytest.raises(ValueError, match=r"`input_ids` \[1, 0\] holds no tokens"):
        model(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"`input_ids` \[0, 4\] holds no tokens"):
        model(torch.zeros(0, 4, dtype=torch.long))
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"`targets` must be token ids in \[0, 300\) or -100 .*got ids from 0 to 517"):
        model.check_tokens(ids, targets=torch.tensor([[0, 517, -100, 1]]))  # what the training step runs
    with pytest.raises(ValueError, match=r"`targets` must be int64 \(or int32\) token ids, got torch.float32"):
        model(ids, targets=torch.zeros(1, 4))
    assert torch.isfinite(model(ids, targets=torch.tensor([[0, 299, -100, 1]])))  # the edges are fine


def test_a_text_prompt_says_to_tokenize_it(model):
    for prompt in ("hello", ["hello"], [[1, 2], "hello"]):
        with pytest.raises(TypeError, match=r"the prompt is text \('hello'\).*tokenizer.encode\(text\)"):
            model.generate(prompt, max_new_tokens=2)
    with pytest.raises(TypeError, match=r"prompt 0 must be a sequence of token ids \(ints\)"):
        model.generate([[1.5, None]], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"`max_new_tokens` must be an int >= 0, got 2.5"):
        model.generate([[1, 2]], max_new_tokens=2.5)


def test_get_config_names_close_fields_and_presets():
    with pytest.raises(
        ValueError,
        match=r"get_config\('kimi-k3-tiny'\): no ModelConfig field 'nonsense'; the fields "
        r"are: name, vocab_size",
    ):
        get_config("kimi-k3-tiny", nonsense=1)
    with pytest.raises(ValueError, match=r"no ModelConfig field 'hiden_size'; did you mean 'hidden_size'"):
        get_config("kimi-k3-tiny", hiden_size=64)
    with pytest.raises(ValueError, match=r"unknown preset 'kimi-k3-tin'; did you mean 'kimi-k3-tiny'"):
        get_config("kimi-k3-tin")
    assert get_config("kimi-k3", last_mla=False).layer_types[-1] == "kda"  # a preset's own argument still works


def test_from_pretrained_of_a_missing_folder_says_what_a_checkpoint_holds(tmp_path):
    with pytest.raises(
        FileNotFoundError,
        match=r"from_pretrained: .*nope: no such folder; a checkpoint folder holds "
        r"config.json and model.safetensors",
    ):
        CausalLM.from_pretrained(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty: no config.json \(expected a checkpoint folder"):
        CausalLM.from_pretrained(tmp_path / "empty")


# -- friction -----------------------------------------------------------------------------------------
def test_your_own_hybrid_is_one_get_config_call():
    pattern = ["kda", "kda", "kda", "mla"] * 2 + ["kda", "mla"]
    config = get_config("kimi-linear-tiny", layer_types=pattern)
    assert config.num_layers == 10 and config.layer_types == pattern
    assert config.mlp_types == ["dense"] + ["moe"] * 9  # the preset's pattern at that depth
    both = get_config("kimi-linear-tiny", layer_types=["kda", "mla"], mlp_types=["moe", "dense"])
    assert both.num_layers == 2 and both.mlp_types == ["moe", "dense"]
    assert CausalLM(both).num_parameters() > 0
    with pytest.raises(ValueError, match=r"`layer_types` has 2, `mlp_types` has 3"):
        get_config("kimi-linear-tiny", layer_types=["kda", "mla"], mlp_types=["dense"] * 3)
    with pytest.raises(ValueError, match=r"`layer_types` has 2, `num_layers` is 4"):
        get_config("kimi-linear-tiny", layer_types=["kda", "mla"], num_layers=4)
    with pytest.raises(ValueError, match=r"`layer_types` must be a list with one entry per layer"):
        get_config("kimi-linear-tiny", layer_types="kda")
    with pytest.raises(ValueError, match=r"unknown layer type 'gru'"):
        get_config("kimi-linear-tiny", layer_types=["kda", "gru"])
    assert TrainConfig(model_overrides={"layer_types": ["kda", "mla"]}).model_overrides  # --set takes it too


def test_the_default_warmup_follows_the_run_length():
    cfg = TrainConfig()
    assert cfg.warmup_steps is None
    assert [warmup_steps(cfg, n) for n in (1, 10, 30, 200, 1000, 5000)] == [1, 1, 2, 10, 50, 50]
    assert warmup_steps(cfg, None) == 50  # a time budget's first steps, before its plan
    assert warmup_steps(TrainConfig(warmup_steps=7), 30) == 7
    lrs = [learning_rate(cfg, step, 30) for step in range(30)]
    assert lrs[1] == cfg.lr and max(lrs) == cfg.lr  # out of the warm-up at step 2 of 30
    assert lrs[-1] == pytest.approx(cfg.lr * cfg.min_lr_ratio)  # WSD's decay ran to its end
    assert lrs[24] < cfg.lr  # the last 20% decay
    assert learning_rate(cfg, 100, None) == cfg.lr  # no schedule length yet: the constant part


def test_help_shows_every_default():
    """Every option has a help text, and one with a default shows it in --help."""

    def parsers(parser):
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from parsers(sub)

    checked = 0
    for parser in parsers(build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            assert action.help, f"{parser.prog} {action.option_strings[0]} has no help"
            if action.default not in (None, False):
                text = formatter._get_help_string(action) % {"default": action.default}
                assert "default" in text, f"{parser.prog} {action.option_strings[0]}: {text!r}"
                checked += 1
    assert checked > 30
    out = subprocess.run([sys.executable, "-m", "k3", "train", "--help"], capture_output=True, text=True).stdout
    for shown in ("(default: 0.003)", "(default: 256)", "(default: 100)", "5% of the run's steps, at most 50"):
        assert shown in " ".join(out.split()), shown


# -- errors that name the right thing -----------------------------------------------------------------
def test_a_broken_config_json_is_named(trained, tmp_path, capsys):
    run = shutil.copytree(trained, tmp_path / "run")
    (run / "config.json").write_text('{"k3": {"name": "x",\n  "hidden_size": 32,\n  "oops"')
    for argv in (
        ["generate", "--checkpoint", str(run), "--prompt", "to"],
        ["params", str(run)],
        ["train", "--resume", str(run), "--no-progress"],
    ):
        err = fails(capsys, argv)
        assert f"{run / 'config.json'}: not valid JSON (" in err and "line 3 column" in err, err


def test_k3_params_says_error_once_and_prints_small_sizes_in_mib(capsys):
    err = fails(capsys, ["params", "nope"])
    assert err.startswith("k3 params: error: 'nope' is neither a preset") and err.count("k3 params") == 1
    assert main(["params", "kimi-k3-tiny"]) == 0
    out = capsys.readouterr().out
    assert "MiB)" in out and "0.0 GiB" not in out
    assert main(["params", "kimi-k3"]) == 0
    assert "TiB)" in capsys.readouterr().out


def test_a_changed_width_is_a_shape_mismatch_not_a_missing_tensor(tmp_path):
    CausalLM(get_config("kimi-k3-tiny", vocab_size=300, num_layers=2)).save_pretrained(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["k3"]["hidden_size"] = 128
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as error:
        CausalLM.from_pretrained(tmp_path / "m")
    assert "shape mismatch" in str(error.value) and "missing" not in str(error.value)
    assert "lm_head.weight: checkpoint [300, 192], model [300, 128]" in str(error.value)


def test_non_utf8_stdin_is_called_stdin(trained):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "k3",
            "generate",
            "--checkpoint",
            str(trained),
            "--threads",
            "1",
            "--max-new-tokens",
            "2",
        ],
        input=b"to be \xff\xfe\nor not\n",
        capture_output=True,
        env={"PATH": "/usr/bin:/bin", "LC_ALL": "C", "PYTHONUTF8": "0"},
    )
    err = done.stderr.decode()
    said = "k3 generate: error: prompt 1: stdin: not UTF-8 text (byte 0xff); give UTF-8 text; skipped"
    assert done.returncode == 0 and said in err, err  # the line after it is still read and continued
    assert err.count("prompt tokens included") == 1 and "command-line argument" not in err


def test_generate_checks_the_manifest_and_takes_threads(trained, tmp_path, capsys):
    run = shutil.copytree(trained, tmp_path / "run")
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps(config))  # the same settings, other bytes: not the save's file
    err = fails(capsys, ["generate", "--checkpoint", str(run), "--prompt", "to"])
    assert f"{run / 'config.json'} has" in err and "its manifest says" in err
    threads = torch.get_num_threads()
    try:
        assert (
            main(
                ["generate", "--checkpoint", str(trained), "--prompt", "to", "--max-new-tokens", "2", "--threads", "1"]
            )
            == 0
        )
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def test_the_header_reports_the_cpu_matmul_on_a_cpu():
    from k3.runtime import machine_speed_words

    assert machine_speed_words(torch.device("cpu")).startswith("this machine's float32 matmul (1024^3): ")
