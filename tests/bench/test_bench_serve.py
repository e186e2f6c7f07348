"""`k3 bench serve`'s load generator against a server in this process: it counts tokens, completes
requests without failures, and (with disconnects) leaves no slot held."""

from __future__ import annotations

import time

import torch

from k3.bench.serve import pct, run_load
from k3.models import CausalLM, get_config
from k3.serve import Engine, ServerThread, build_app
from k3.tokenizer import byte_tokenizer


def test_load_counts_tokens_and_leaves_nothing_held():
    torch.manual_seed(0)
    model = CausalLM(get_config("kimi-k3-tiny", vocab_size=257, hidden_size=32)).eval()
    engine = Engine(model, cache_memory=10**8, max_running=16, max_length=256)
    with ServerThread(build_app(engine, byte_tokenizer(), "tiny"), engine) as server:
        intruder = ([5] * 100, 3)  # one more request as the window opens, counted apart
        load = run_load(server.port, [1, 2, 3, 4], 8, 3, 1.5, disconnect=0.5, warmup=0.2, intruder=intruder)
        assert load.failed == 0 and load.tokens > 0 and load.completed > 0 and load.disconnected > 0
        assert load.ttft and load.itl
        assert load.intruder.completed == 1 and load.intruder.failed == 0 and len(load.intruder.ttft) == 1
        assert load.summary()["intruder"]["completed"] == 1
        deadline = time.time() + 5
        while engine.stats()["running"] and time.time() < deadline:
            time.sleep(0.02)
        stats = engine.stats()
        assert stats["running"] == 0 and stats["cache_bytes_reserved"] == 0


def test_pct():
    assert pct([3, 1, 2], 50) == 2 and pct([5], 99) == 5
    assert pct([], 50) != pct([], 50)  # NaN
