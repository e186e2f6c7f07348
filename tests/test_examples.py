"""The scripts in examples/ run as a user would run them (a fresh interpreter, tiny settings)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3.models import CausalLM, get_config

from .corpus import write_corpus

pytestmark = pytest.mark.slow  # each example in a fresh interpreter

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def corpus(root: Path, docs: int, words: int) -> Path:
    root.mkdir()
    return write_corpus(root, docs=docs, words=words, ending=".\n")


def run_example(name: str, *args: str, cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(EXAMPLES.parent), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_train_tiny(tmp_path):
    out = run_example(
        "train_tiny.py",
        "--data",
        str(corpus(tmp_path / "corpus", 3, 400)),
        "--steps",
        "3",
        "--out",
        str(tmp_path / "run"),
        "--prompt",
        "the",
        cwd=tmp_path,
    )
    assert "bits per byte after 3 steps" in out
    assert (tmp_path / "run" / "model.safetensors").exists()


def test_kimi_linear_generate(tmp_path):
    pytest.importorskip("transformers")
    from k3.hf.export import export
    from k3.tokenizer import train_bpe

    texts = [p.read_text() for p in corpus(tmp_path / "corpus", 2, 200).iterdir()]
    tokenizer = train_bpe(texts, vocab_size=280)
    torch.manual_seed(0)
    CausalLM(get_config("kimi-linear-tiny", vocab_size=tokenizer.vocab_size, hidden_size=32)).save_pretrained(
        tmp_path / "k3"
    )
    tokenizer.save(tmp_path / "k3" / "tokenizer.json")
    export(tmp_path / "k3", tmp_path / "kimi", format="kimi-linear")
    out = run_example(
        "kimi_linear_generate.py",
        str(tmp_path / "kimi"),
        "--prompt",
        "the",
        "--max-new-tokens",
        "5",
        "--dtype",
        "float32",
        cwd=tmp_path,
    )
    assert "parameters, layers ['kda'" in out
    assert len(out.strip().splitlines()) == 2


def test_lab_experiment(tmp_path):
    out = run_example("lab_experiment.py", "decode", "--mode", "smoke", "--out", str(tmp_path / "lab"), cwd=tmp_path)
    assert "measured:" in out and (tmp_path / "lab" / "results.md").exists()
