"""The server tests' shared set-up: a tiny kimi-k3-tiny checkpoint with the byte tokenizer, a server of it
on a free local port (`server`, one a test module), `start` for a server with other settings, and `post`
(one raw HTTP request) and `wait_idle` (until the engine holds nothing)."""

from __future__ import annotations

import http.client
import json
import time

import pytest
import torch

from k3.models import CausalLM, get_config
from k3.serve import Engine, ServerThread, build_app
from k3.tokenizer import byte_tokenizer

NAME = "tiny"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve")
    torch.manual_seed(0)
    CausalLM(get_config("kimi-k3-tiny", vocab_size=257, hidden_size=32)).save_pretrained(path)
    byte_tokenizer().save(path / "tokenizer.json")
    return path


def start(model, **kw) -> ServerThread:
    engine = Engine(
        model,
        cache_memory=kw.pop("cache_memory", 10**9),
        max_queue=kw.pop("max_queue", 256),
        max_running=kw.pop("max_running", 32),
        max_length=kw.get("max_model_len") or 512,
        compile=kw.pop("compile", False),
        prefix_cache=kw.pop("prefix_cache", True),
        prefill_chunk=kw.pop("prefill_chunk", 256),
    )
    return ServerThread(build_app(engine, byte_tokenizer(), NAME, **kw), engine)


@pytest.fixture(scope="module")
def server(checkpoint):
    with start(CausalLM.from_pretrained(checkpoint).eval(), max_model_len=512) as s:
        yield s


def post(server, path: str, body: bytes | str, headers: dict | None = None) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request(
        "POST",
        path,
        body.encode() if isinstance(body, str) else body,
        {"Content-Type": "application/json", **(headers or {})},
    )
    r = conn.getresponse()
    out = json.loads(r.read() or b"{}")
    conn.close()
    return r.status, out, dict(r.getheaders())


def wait_idle(server, timeout: float = 10.0) -> dict:
    deadline = time.time() + timeout
    while True:
        stats = server.engine.stats()
        if stats["running"] == 0 and stats["waiting"] == 0 and stats["cache_bytes_reserved"] == 0:
            return stats
        assert time.time() < deadline, stats
        time.sleep(0.02)


def poison_sampling(monkeypatch, bad, message: str = "poisoned row") -> None:
    """Make the engine's draw (`k3.serve.sampler.sample_turn`) raise RuntimeError(message) whenever it holds a
    row `bad(sequence)` picks: a sampling failure no request can cause, to test that it stays the row's own."""
    import k3.serve.sampler as sampler_module

    real = sampler_module.sample_turn

    def poisoned(logits, rows, noise):
        if any(bad(s) for s in rows):
            raise RuntimeError(message)
        return real(logits, rows, noise)

    monkeypatch.setattr(sampler_module, "sample_turn", poisoned)
