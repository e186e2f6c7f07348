"""`k3 generate --compile`: the same greedy text as eager for --prompt, --prompt-file and --chat (the
compile backend swapped for "aot_eager", which needs no C++ compiler and compiles in seconds); the
one-line errors; and, marked slow, a real inductor compile whose second run loads from the disk cache."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from k3 import runtime
from k3.cli import main
from k3.inference import decode_step
from k3.models import CausalLM, get_config
from k3.tokenizer import byte_tokenizer

ROOT = Path(__file__).resolve().parents[1]
GREEDY = ["--max-new-tokens", "6", "--temperature", "0"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("compile")
    torch.manual_seed(0)
    CausalLM(get_config("kimi-k3-tiny", vocab_size=257, hidden_size=32)).save_pretrained(path)
    byte_tokenizer().save(path / "tokenizer.json")
    return path


@pytest.fixture
def aot_eager(monkeypatch):
    """compile=True compiles with "aot_eager" (what inductor would capture, without building C++)."""
    original = decode_step.compile_step
    monkeypatch.setattr(
        decode_step, "compile_step", lambda fn, device, backend="inductor": original(fn, device, "aot_eager")
    )
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def run(monkeypatch, capsys, argv, stdin: str = ""):
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("mode", ["prompt", "prompt-file", "chat"])
def test_compiled_text_equals_eager(mode, checkpoint, aot_eager, monkeypatch, capsys, tmp_path):
    argv = ["generate", "--checkpoint", str(checkpoint), *GREEDY]
    stdin = ""
    if mode == "prompt":
        argv += ["--prompt", "Hello"]
    elif mode == "prompt-file":
        (tmp_path / "p.txt").write_text("Hi\nA longer prompt\n")
        argv += ["--prompt-file", str(tmp_path / "p.txt")]
    else:
        argv += ["--chat"]
        stdin = "first turn\nsecond\n"
    code, eager, _ = run(monkeypatch, capsys, argv, stdin)
    assert code == 0
    code, compiled, err = run(monkeypatch, capsys, argv + ["--compile"], stdin)
    assert code == 0 and compiled == eager
    assert "--compile: the first tokens wait while the decode step compiles" in err
    if mode != "prompt-file":  # a streamed continuation's speed line splits off the step's first call
        assert "s of it compiling or loading the decode step, then" in err


def test_compile_errors_are_one_line(checkpoint, monkeypatch, capsys):
    monkeypatch.setattr(runtime, "cxx_compiler", lambda: None)
    code, _, err = run(monkeypatch, capsys, ["generate", "--checkpoint", str(checkpoint), "--prompt", "x", "--compile"])
    assert code != 0 and "no C++ compiler was found" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_inductor_compile_then_a_cached_start(checkpoint, tmp_path):
    """A real compile (C++ kernels) gives eager's greedy text; a second process loads it from the cache."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "k3", "generate", "--checkpoint", str(checkpoint), "--prompt", "Hello", *GREEDY]
    eager = subprocess.run(argv, capture_output=True, text=True, env=env, check=True).stdout
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        done = subprocess.run(argv + ["--compile"], capture_output=True, text=True, env=env, check=True)
        seconds.append(time.perf_counter() - start)
        assert done.stdout == eager
    assert any((tmp_path / "inductor").rglob("*")), "nothing was cached"
    assert seconds[1] < seconds[0], seconds
