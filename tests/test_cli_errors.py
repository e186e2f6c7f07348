"""Every failure a user can cause ends in one line, `k3 <command>: error: ...`, and exit code 2 (Ctrl-C in
`k3 generate`: exit 130, the text so far kept): bad flags, bad --set, sizes that cannot fit, damaged
checkpoint files, bad prompts, --resume with settings it would ignore."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from k3 import runtime
from k3.cli import main
from k3.inference.generation import sample
from k3.models import CausalLM
from k3.tokenizer import Tokenizer, byte_tokenizer
from k3.training import TrainConfig, build_optimizer
from k3.training.checkpoint import save_training_checkpoint
from k3.training.config import max_threads, model_config

from .commands import fails
from .corpus import write_corpus

THREADS = f"--threads: expected torch threads, an integer in [1, {max_threads()}]"

TINY_RUN = [
    "--tokenizer",
    "byte",
    "--hidden-size",
    "32",
    "--seq-len",
    "32",
    "--batch-size",
    "2",
    "--eval-every",
    "1",
    "--eval-tokens",
    "64",
    "--no-progress",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"), docs=4, words=300)


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory):
    """A checkpoint as `k3 train --data corpus --max-steps 1 TINY_RUN` writes it, without the training."""
    out = tmp_path_factory.mktemp("run")
    cfg = TrainConfig(
        model_overrides={"hidden_size": 32},
        data=str(corpus),
        tokenizer="byte",
        seq_len=32,
        batch_size=2,
        max_steps=1,
        out=str(out),
    )
    model = CausalLM(model_config(cfg, 257))
    history = {"step": [], "loss": [], "lr": [], "val_step": [], "val_bpb": [], "tokens": 0, "seconds": 0.0}
    save_training_checkpoint(
        out, model, build_optimizer(model, cfg), byte_tokenizer(), cfg, 0, 1, torch.Generator(), history
    )
    return out


@pytest.fixture
def damaged(run, tmp_path):
    """A copy of the run's checkpoint, to damage."""
    return lambda: shutil.copytree(run, tmp_path / "copy")


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--max-steps", "0"], "--max-steps: expected training steps, an integer >= 1, got '0'"),
        (["--max-steps", "-3"], "got '-3'"),
        (["--time-budget", "-1"], "--time-budget: expected minutes, a finite number > 0 and <= 527040, got '-1'"),
        (["--checkpoint-every", "-1"], "--checkpoint-every: expected steps between checkpoints, an integer >= 1"),
        (["--warmup", "-5"], "--warmup: expected warmup steps, an integer >= 0, got '-5'"),
        (["--threads", "-1"], f"--threads: expected torch threads, an integer in [1, {max_threads()}], got '-1'"),
        (["--threads", "100000"], f"--threads: expected torch threads, an integer in [1, {max_threads()}]"),
        (["--lr", "nan"], "--lr: expected a learning rate, a finite number > 0, got 'nan'"),
        (["--vocab-size", "100"], "--vocab-size: expected BPE entries"),
        (
            ["--set", "bogus_field=1"],
            "no ModelConfig field 'bogus_field'; the fields are: name, vocab_size, hidden_size",
        ),
        (["--set", "hiden_size=64"], "did you mean 'hidden_size'"),
        (["--set", "hidden_size=abc"], "`hidden_size` must be an integer, got 'abc'"),
        (["--set", "layer_types=[]"], "`layer_types` is empty; give one entry per layer"),
        (["--set", 'layer_types=["kda","mla"'], "`layer_types` must be a list with one entry per layer"),
        (["--set", 'layer_types=["kda", "mla"]', "--num-layers", "3"], "`layer_types` has 2, `num_layers` is 3"),
        (
            ["--set", "vocab_size=10", "--tokenizer", "byte"],
            "--set vocab_size=10: the model's vocabulary is the tokenizer's (--tokenizer byte gives 257 tokens)",
        ),
        (["--set", "hidden_size=64", "--hidden-size", "96"], "--set hidden_size=64 and --hidden-size 96 both set"),
        (["--set", "num_layers=3", "--num-layers", "4"], "--set num_layers=3 and --num-layers 4 both set"),
        (["--max-steps", "2", "--time-budget", "1"], "--max-steps 2 and --time-budget 1 both set the run's length"),
        (["--set", "hidden_size"], "--set expects FIELD=VALUE, got 'hidden_size'"),
    ],
)
def test_bad_train_settings_are_refused_before_any_work(capsys, tmp_path, flags, expected):
    fails(capsys, ["train", "--data", str(tmp_path / "never read"), "--out", str(tmp_path / "out"), *flags], expected)
    assert not (tmp_path / "out").exists()


def test_train_config_checks_its_fields():
    for bad, expected in [
        ({"max_steps": 0}, "`max_steps` must be an integer >= 1"),
        ({"time_budget": float("nan")}, "`time_budget` must be a finite number"),
        ({"warmup_steps": -5}, "`warmup_steps` must be an integer >= 0, or None (5% of the steps, at most 50), got -5"),
        ({"max_steps": 2, "time_budget": 1.0}, "`max_steps` 2 and `time_budget` 1.0 both set"),
        ({"model_overrides": {"vocab_size": 10}}, "`vocab_size` 10 would be replaced by the tokenizer's vocabulary"),
        ({"threads": 0}, "`threads` must be an integer in [1, "),
        ({"threads": 10**5}, "`threads` must be an integer in [1, "),
        ({"checkpoint_every": -1}, "`checkpoint_every` must be an integer >= 1"),
        ({"betas": (0.9, 1.5)}, "`betas` must be two numbers in [0, 1)"),
        ({"preset": "gpt5"}, "unknown preset 'gpt5'"),
    ]:
        with pytest.raises(ValueError, match=re.escape(expected)):
            TrainConfig(**bad)


def test_a_vocabulary_that_cannot_fit_is_refused_before_the_bpe_trainer_allocates(
    corpus, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(runtime, "available_memory", lambda: 8 << 30)  # the same answer on any machine
    fails(
        capsys,
        [
            "train",
            "--data",
            str(corpus),
            "--tokenizer",
            "bpe",
            "--vocab-size",
            "1000000000",
            "--max-steps",
            "1",
            "--out",
            str(tmp_path / "out"),
        ],
        "a BPE vocabulary of 1,000,000,000 entries needs about 93.1 GiB (100,000,000,000 bytes)",
        "8.0 GiB",
    )


def test_a_model_that_cannot_fit_is_refused_before_training_allocates(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(runtime, "available_memory", lambda: 1 << 20)
    fails(
        capsys,
        ["train", "--data", str(corpus), *TINY_RUN, "--max-steps", "1", "--out", str(tmp_path / "out")],
        "training 'kimi-k3-tiny' (1,067,916 parameters x 16 bytes, the activations of 2 x 32 tokens and the step's "
        "2 token windows: --batch-size 2 x --grad-accum 1) needs about 0.0 GiB",
        "more than the 0.0 GiB of memory available",
        "--batch-size",
    )


def test_a_config_json_of_another_size_is_refused_before_the_model_is_built(damaged, capsys, monkeypatch):
    copy = damaged()
    config = json.loads((copy / "config.json").read_text())
    config["k3"]["hidden_size"] = 200_000
    (copy / "config.json").write_text(json.dumps(config))
    built = []
    monkeypatch.setattr(CausalLM, "from_pretrained", lambda *a, **k: built.append(1))
    argv = ["generate", "--checkpoint", str(copy), "--prompt", "to be"]
    fails(capsys, argv, f"--checkpoint {copy} does not match", "model [257, 200000]")
    monkeypatch.setattr(runtime, "available_memory", lambda: 1 << 30)
    fails(
        capsys,
        argv,
        f"--checkpoint {copy}: loading 'kimi-k3-tiny' (",
        "parameters x 4 bytes) needs about",
        "more than the 1.0 GiB of memory available",
    )
    assert not built


@pytest.mark.parametrize("content, expected", [(b"", "header too small"), (None, "file not fully covered")])
def test_a_damaged_model_safetensors_is_named(damaged, capsys, content, expected):
    copy = damaged()
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100] if content is None else content)
    for argv in (
        ["generate", "--checkpoint", str(copy), "--prompt", "to be"],
        ["train", "--resume", str(copy), "--max-steps", "2"],
        ["lab", "inspect", "--checkpoint", str(copy), "--smoke"],
    ):
        fails(capsys, argv, f"{copy}: model.safetensors is damaged or not a safetensors file", expected)


def test_a_malformed_tokenizer_json_is_named(damaged, capsys):
    copy = damaged()
    (copy / "tokenizer.json").write_text((copy / "tokenizer.json").read_text()[:100])
    fails(
        capsys,
        ["generate", "--checkpoint", str(copy), "--prompt", "to be"],
        f"{copy / 'tokenizer.json'} is not a readable tokenizer.json (EOF while parsing",
    )


@pytest.mark.parametrize("state", [b"not a zip archive", "truncated"])
def test_lab_inspect_refuses_a_damaged_trainer_state_before_the_analysis(damaged, capsys, monkeypatch, state):
    import k3.lab

    copy = damaged()
    path = copy / "trainer_state.pt"
    path.write_bytes(path.read_bytes()[:200] if state == "truncated" else state)
    monkeypatch.setattr(k3.lab, "run", lambda *a, **k: pytest.fail("the analysis ran"))
    fails(
        capsys,
        ["lab", "inspect", "--checkpoint", str(copy), "--smoke", "--docs", str(copy / "docs")],
        f"--checkpoint {copy}: trainer_state.pt is damaged",
    )


def test_bad_prompts_and_sampling_flags(run, tmp_path, capsys):
    generate = ["generate", "--checkpoint", str(run)]
    fails(
        capsys,
        [*generate, "--prompt", "to b\udcff"],
        "--prompt: the text has '\\udcff' at character 4, a lone surrogate",
        "give UTF-8 text",
    )
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"to be\nor \xff not\n")
    fails(capsys, [*generate, "--prompt-file", str(prompts)], "not UTF-8 text (byte 0xff at offset 9)")
    for value in ("nan", "-1", "inf"):
        fails(
            capsys,
            [*generate, "--prompt", "to be", "--temperature", value],
            f"--temperature: expected a sampling temperature (0: greedy), a finite number >= 0, got '{value}'",
        )
    fails(capsys, [*generate, "--prompt", "to be", "--top-p", "1.5"], "a finite number > 0 and <= 1, got '1.5'")
    with pytest.raises(ValueError, match="`temperature` must be a finite number >= 0"):
        sample(torch.zeros(1, 4), temperature=float("nan"))


def test_ctrl_c_in_generate_keeps_the_text_and_exits_130(run, capsys, monkeypatch):
    def stream(self, prompt, *args, **kwargs):
        for token in Tokenizer.load(run).encode("xy"):
            yield torch.tensor([token])
        raise KeyboardInterrupt

    monkeypatch.setattr(CausalLM, "stream", stream)
    assert main(["generate", "--checkpoint", str(run), "--prompt", "to be"]) == 130
    captured = capsys.readouterr()
    assert captured.out == "to bexy\n" and "interrupted (Ctrl-C) after 2 tokens" in captured.err


def test_resume_refuses_settings_it_would_ignore(run, corpus, tmp_path, capsys):
    other = write_corpus(tmp_path, docs=2, words=50)
    resume = ["train", "--resume", str(run), "--max-steps", "2", "--no-progress"]
    fails(
        capsys,
        [*resume, "--data", str(other)],
        f"`data` '{other}' (the checkpoint's: '{corpus}')",
        "drop the others to resume",
    )
    fails(
        capsys,
        [*resume, "--hidden-size", "48"],
        "`model_overrides` {'hidden_size': 48} (the checkpoint's: {'hidden_size': 32})",
    )
    fails(capsys, [*resume, "--lr", "0.01", "--seed", "3"], "`lr` 0.01", "; `seed` 3 (the checkpoint's: 0)")


def test_generate_from_a_missing_folder_says_so(capsys, tmp_path):
    assert main(["generate", "--checkpoint", str(tmp_path / "nowhere"), "--prompt", "hi"]) == 2
    assert "no such folder" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["bench", "profile", "--rounds", "0"], "--rounds: expected timing rounds, an integer >= 1, got '0'"),
        (["bench", "profile", "--threads", "0"], f"{THREADS}, got '0'"),
        (["bench", "backward", "--rounds", "-2"], "--rounds: expected timing rounds, an integer >= 1, got '-2'"),
        (["bench", "backward", "--threads", "-1"], f"{THREADS}, got '-1'"),
        (["bench", "models", "--threads", "x"], f"{THREADS}, got 'x'"),
    ],
)
def test_bad_bench_counts_are_refused_before_any_work(capsys, argv, expected):
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"k3 bench {argv[1]}: error: ") and expected in err, err


def test_a_batch_whose_activations_cannot_fit_is_refused_before_the_tokenizer_or_any_allocation(
    corpus, tmp_path, capsys, monkeypatch
):
    """The memory estimate counts the activations the backward keeps and the logits, not only parameters x 16
    bytes: --batch-size 10000000 is refused at once, naming the flags, before the corpus is tokenized."""
    from k3.training import loop

    def no_work(*args, **kwargs):
        raise AssertionError("the run prepared its data before its size was checked")

    monkeypatch.setattr(loop, "prepare_data", no_work)
    monkeypatch.setattr(runtime, "available_memory", lambda: 22 << 30)
    for flags in (["--batch-size", "10000000"], ["--tokenizer", "bpe", "--batch-size", "10000000"]):
        err = fails(
            capsys,
            ["train", "--data", str(corpus), *flags, "--max-steps", "1", "--out", str(tmp_path / "o")],
            "the activations of 10000000 x 256 tokens",
            "more than the 22.0 GiB of memory available",
            "--batch-size",
            "--seq-len",
        )
        assert "Traceback" not in err
    # kimi-k3-tiny at width 100,000: its parameters alone (about 21.8 GiB) fit in 22.2 GiB, its activations do not
    monkeypatch.setattr(runtime, "available_memory", lambda: int(22.2 * 2**30))
    fails(
        capsys,
        [
            "train",
            "--data",
            str(corpus),
            "--tokenizer",
            "byte",
            "--hidden-size",
            "100000",
            "--max-steps",
            "1",
            "--out",
            str(tmp_path / "o"),
        ],
        "training 'kimi-k3-tiny'",
        "--hidden-size",
    )
    assert not (tmp_path / "o").exists()
    # micro-batches count: a billion of them would be drawn as one step's windows
    err = fails(
        capsys,
        [
            "train",
            "--data",
            str(corpus),
            "--grad-accum",
            "1000000000",
            "--max-steps",
            "1",
            "--out",
            str(tmp_path / "o"),
        ],
        "the step's 8,000,000,000 token windows: --batch-size 8 x --grad-accum 1000000000",
        "more than the 22.2 GiB of memory available",
        "--grad-accum",
    )
    assert "Traceback" not in err and not (tmp_path / "o").exists()


def test_a_seed_out_of_range_is_refused_naming_the_flag(corpus, tmp_path, capsys):
    fails(
        capsys,
        ["train", "--data", str(corpus), *TINY_RUN, "--seed", str(2**64), "--out", str(tmp_path / "o")],
        f"argument --seed: expected a seed, an integer in [0, {2**64 - 1}], got '{2**64}'",
    )
    with pytest.raises(ValueError, match=re.escape("`TrainConfig.seed` must be an int in [0, 2**64 - 1]")):
        TrainConfig(seed=-1)


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--checkpoint", "never read", "--prompt", "to", "--threads", "3000"],
        ["bench", "llama", "--threads", "100000"],
        ["bench", "serve", "--threads", "100000"],
    ],
)
def test_threads_past_the_bound_are_refused_by_every_command(capsys, argv):
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    command = " ".join(argv[:2] if argv[0] == "bench" else argv[:1])
    assert "\n" not in err and err.startswith(f"k3 {command}: error: argument --threads: expected torch threads"), err
    assert f"an integer in [1, {max_threads()}]" in err and "a core of this machine's" in err, err


def test_a_parser_without_the_bound_still_gets_it_where_threads_are_used():
    """k3 serve's parser builds --threads itself: use_threads, which every command calls first, refuses too."""
    from argparse import Namespace

    from k3.cli.common import use_threads

    with pytest.raises(ValueError, match=re.escape("--threads 3000: expected torch threads, an integer in [1, ")):
        use_threads(Namespace(threads=3000, command="serve"))


def test_more_threads_than_cores_and_a_vocabulary_the_corpus_cannot_give_are_said(corpus, tmp_path, capsys):
    import os

    threads = (os.cpu_count() or 1) + 1
    assert (
        main(
            [
                "train",
                "--data",
                str(corpus),
                "--tokenizer",
                "bpe",
                "--vocab-size",
                "100000",
                "--hidden-size",
                "32",
                "--seq-len",
                "32",
                "--batch-size",
                "2",
                "--max-steps",
                "1",
                "--eval-tokens",
                "64",
                "--final-eval-tokens",
                "64",
                "--threads",
                str(threads),
                "--no-progress",
                "--out",
                str(tmp_path / "o"),
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert f"k3 train: warning: --threads {threads} is more than this machine's {os.cpu_count()} cores" in err, err
    assert "k3 train: warning: --vocab-size 100000: the corpus gave the BPE tokenizer only" in err, err


@pytest.mark.parametrize("argv", [["train", "--bogus"], ["bench", "ops", "--bogus", "1"], ["plan", "--bogus"]])
def test_an_unknown_flag_is_named_by_its_subcommand(capsys, argv):
    capsys.readouterr()
    assert main(argv) == 2
    command = "k3 " + " ".join(argv[:2] if argv[0] == "bench" else argv[:1])
    rest = " ".join(argv[2:] if argv[0] == "bench" else argv[1:])
    assert capsys.readouterr().err == f"{command}: error: unrecognized arguments: {rest} (see {command} --help)\n"


def test_ctrl_c_while_torch_loads_is_noted_not_raised():
    """Raised inside `import torch`, a KeyboardInterrupt can abort the process from C++: main only notes it."""
    import signal

    from k3.cli import _ctrl_c_deferred

    previous = signal.getsignal(signal.SIGINT)
    with _ctrl_c_deferred() as pressed:
        signal.raise_signal(signal.SIGINT)
    assert pressed == [signal.SIGINT] and signal.getsignal(signal.SIGINT) is previous


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["bench", "serve", "--disconnect", "0.5"], "--disconnect 0.5: a setting of the --soak load; give --soak"),
        (["bench", "serve", "--cache-memory", "abc"], "--cache-memory: expected a size such as 512MiB"),
    ],
)
def test_bench_serve_names_a_flag_it_would_ignore_or_cannot_read(capsys, argv, expected):
    fails(capsys, argv, expected)
