"""Fixtures for the lm-eval adapter tests: a `k3 train` checkpoint (kimi-k3-tiny at width 32, one step
on a small local corpus, BPE tokenizer) and a GPT-2 `save_pretrained` directory with 16 positions and
its tokenizer beside it; lm-eval kept off the network."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from k3.models import CausalLM, get_config
from k3.tokenizer import train_bpe
from k3.training import TrainConfig, train

from ..corpus import write_corpus

TASKS = Path(__file__).parent / "tasks"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The models are tiny: one thread is fastest, and the fairest on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("eval_corpus"), docs=3, words=300, ending=".\n")


@pytest.fixture(scope="session")
def k3_checkpoint(tmp_path_factory, corpus) -> Path:
    """What `k3 train --out DIR` writes, after one step."""
    out = tmp_path_factory.mktemp("k3_train")
    threads = torch.get_num_threads()
    train(
        TrainConfig(
            preset="kimi-k3-tiny",
            model_overrides={"hidden_size": 32},
            data=str(corpus),
            tokenizer="bpe",
            vocab_size=300,
            seq_len=32,
            batch_size=2,
            max_steps=1,
            warmup_steps=1,
            eval_every=1,
            eval_tokens=64,
            final_eval_tokens=64,
            out=str(out),
            threads=1,
        ),
        progress=False,
    )
    torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="session")
def gpt2_checkpoint(tmp_path_factory, corpus) -> tuple[Path, Path]:
    """A save_pretrained directory (no tokenizer in it) of a GPT-2 with 16 learned positions, and a tokenizer.json."""
    root = tmp_path_factory.mktemp("gpt2")
    tokenizer = train_bpe([p.read_text() for p in corpus.iterdir()], vocab_size=280)
    torch.manual_seed(0)
    model = CausalLM(
        get_config("gpt2-tiny", vocab_size=tokenizer.vocab_size, hidden_size=32, max_position_embeddings=16)
    )
    model.save_pretrained(root / "model")
    tokenizer.save(root / "tokenizer.json")
    return root / "model", root / "tokenizer.json"


@pytest.fixture
def no_network(monkeypatch, tmp_path):
    """Every attempt to open a connection is recorded and refused (the test asserts there were none);
    Hugging Face libraries told to stay offline; datasets' cache in a temporary folder."""
    datasets = pytest.importorskip("datasets")
    attempts: list = []

    def refuse(self, address, *args, **kwargs):
        attempts.append(address)
        raise OSError(f"network access attempted during an offline test: {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets")
    return attempts
