"""A model `k3 train` trained, exported with `k3 export --format gguf`, answers three prompts in llama.cpp
(llama-cpp-python's own completion call, greedy) with the same continuation as `k3 generate
--temperature 0`. (The same check on a `make demo` run is in docs/llama.md.)"""

from __future__ import annotations

import os

import pytest

from k3.cli import main
from k3.training import TrainConfig, train
from tests.corpus import write_corpus

from .llama import load

pytestmark = pytest.mark.gguf
if not os.environ.get("K3_LLAMA_CPP_SOURCE"):
    pytest.importorskip("llama_cpp")

PROMPTS = ["to be or", "the question whether", "nobler in mind"]
TOKENS = 24


def k3_continuation(capsys, run, prompt: str) -> str:
    capsys.readouterr()
    argv = ["generate", "--checkpoint", str(run), "--prompt", prompt, "--max-new-tokens", str(TOKENS)]
    assert main([*argv, "--temperature", "0"]) == 0
    return capsys.readouterr().out


def test_a_trained_model_continues_alike_in_llama_cpp(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    write_corpus(data, docs=40, words=400)
    cfg = TrainConfig(
        data=str(data), vocab_size=512, max_steps=60, eval_every=1000, final_eval_tokens=4096, seq_len=128
    )
    cfg.out = str(tmp_path / "run")
    train(cfg, progress=False)
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "gguf"), "--format", "gguf"]) == 0
    llm = load(tmp_path / "gguf" / "model.gguf")
    for prompt in PROMPTS:
        theirs = llm.create_completion(prompt, max_tokens=TOKENS, temperature=0.0)["choices"][0]["text"]
        ours = k3_continuation(capsys, tmp_path / "run", prompt)
        assert theirs and theirs in ours, (prompt, theirs, ours)
