"""`k3 serve` over HTTP, with the official `openai` client against a server on a free local port: the same
greedy text as `k3 generate`, streaming or not; concurrent requests each as alone; a disconnect frees its
slot; an API key, a full queue, draining, and a stopping server's clean ends (bad input:
test_server_errors.py)."""

from __future__ import annotations

import http.client
import json
import logging
import os
import queue
import signal
import threading
import time
from types import SimpleNamespace

import openai
import pytest
import torch

from k3.cli import main
from k3.models import CausalLM
from k3.serve import Engine, ServerThread, build_app, serve
from k3.serve.text import chat_prompt
from k3.tokenizer import byte_tokenizer

from .conftest import NAME, post, start, wait_idle


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def generated(capsys, checkpoint, prompt: str, n: int) -> str:
    """`k3 generate`'s greedy continuation of `prompt` (what it prints after the prompt)."""
    capsys.readouterr()
    assert (
        main(
            [
                "generate",
                "--checkpoint",
                str(checkpoint),
                "--prompt",
                prompt,
                "--max-new-tokens",
                str(n),
                "--temperature",
                "0",
            ]
        )
        == 0
    )
    return capsys.readouterr().out[len(prompt) : -1]  # less the prompt and the closing newline


def test_completion_equals_k3_generate(client, checkpoint, capsys):
    expected = generated(capsys, checkpoint, "Hello", 12)
    r = client.completions.create(model=NAME, prompt="Hello", max_tokens=12, temperature=0)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 12, 17)
    stream = client.completions.create(model=NAME, prompt="Hello", max_tokens=12, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_completion_equals_k3_generate(client, checkpoint, capsys):
    messages = [{"role": "user", "content": "Hi there"}]
    prompt = chat_prompt(messages)
    expected = generated(capsys, checkpoint, prompt, 10)
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0, stop=["\n\n\n"])
    # the plain template stops at a new "User:"/"System:" line; the text is what generate gives up to there
    assert expected.startswith(r.choices[0].message.content) and r.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_chat_content_parts_and_the_developer_role_as_clients_send_them(client):
    """Content as a list of text parts (guidellm, the openai client's typed messages) is the parts joined
    with newlines; `developer` is a system message; an image part is refused naming it; models.retrieve works."""
    plain = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi\nthere"}]
    parts = [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief"}]},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
    ]
    want = client.chat.completions.create(model=NAME, messages=plain, max_tokens=8, temperature=0)
    got = client.chat.completions.create(model=NAME, messages=parts, max_tokens=8, temperature=0)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError, match="part 0 is of type 'image_url': this model reads text only"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": [image]}], max_tokens=2)
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_stop_n_seed_and_models(client):
    r = client.completions.create(model=NAME, prompt="Hello", max_tokens=12, temperature=0)
    text = r.choices[0].text
    stop = text[3:5]
    cut = client.completions.create(model=NAME, prompt="Hello", max_tokens=12, temperature=0, stop=stop)
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    a = client.completions.create(model=NAME, prompt="Hello", max_tokens=8, temperature=1, seed=7, n=3)
    b = client.completions.create(model=NAME, prompt="Hello", max_tokens=8, temperature=1, seed=7, n=3)
    assert [c.text for c in a.choices] == [c.text for c in b.choices] and len(a.choices) == 3
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [m.id for m in client.models.list().data] == [NAME]


def test_concurrent_requests_each_as_alone(checkpoint):
    """16 requests of different prompt and output lengths at once (float64: batching moves only rounding)."""
    model = CausalLM.from_pretrained(checkpoint).to(torch.float64).eval()
    tok = byte_tokenizer()
    texts = [("ROMEO: " * (1 + i % 5))[: 3 + 4 * i] for i in range(16)]
    lengths = [4 + i % 9 for i in range(16)]
    expected = [
        tok.decode(
            model.generate([tok.encode(t)], n, temperature=0, eos_token_id=tok.eot_id)[0][len(tok.encode(t)) :].tolist()
        )
        for t, n in zip(texts, lengths)
    ]
    with start(model) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        results = [None] * 16

        def ask(i):
            results[i] = (
                client.completions.create(model=NAME, prompt=texts[i], max_tokens=lengths[i], temperature=0)
                .choices[0]
                .text
            )

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert results == expected
        assert s.engine.peak_running > 1
        wait_idle(s)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_frees_the_slot(server, stream):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps({"model": NAME, "prompt": "Hi", "max_tokens": 500, "ignore_eos": True, "stream": stream}),
        {"Content-Type": "application/json"},
    )
    deadline = time.time() + 10
    while server.engine.stats()["running"] == 0:
        assert time.time() < deadline
        time.sleep(0.01)
    if stream:
        r = conn.getresponse()
        assert r.status == 200 and r.readline().startswith(b"data: ")
    conn.sock.shutdown(2)
    conn.close()
    stats = wait_idle(server, 5)
    assert stats["running"] == 0


def test_api_key(checkpoint):
    with start(CausalLM.from_pretrained(checkpoint).eval(), api_key="sk-k3") as s:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="sk-k3", max_retries=0)
        assert good.completions.create(model=NAME, prompt="a", max_tokens=2).usage.completion_tokens == 2
        conn = http.client.HTTPConnection("127.0.0.1", s.port)
        conn.request("GET", "/health")
        health = conn.getresponse()
        assert health.status == 200 and health.read()  # health needs no key
        # the scheme in any case (RFC 7235), one or more spaces before the key; another scheme or key: 401
        tried = {"bearer sk-k3": 200, "BEARER  sk-k3": 200, "Basic sk-k3": 401, "Bearer sk-k": 401}
        for header, status in tried.items():
            conn.request("GET", "/v1/models", headers={"Authorization": header})
            answer = conn.getresponse()
            assert (answer.status, answer.read() and header) == (status, header)
        for method in ("TRACE", "PUT", "DELETE"):  # no route takes them: 405 with or without the key
            conn.request(method, "/v1/completions")
            answer = conn.getresponse()
            assert (answer.status, json.loads(answer.read())["error"]["code"]) == (405, 405)
        conn.request("HEAD", "/v1/models")
        assert conn.getresponse().status == 401  # a GET route's HEAD needs the key as its GET does
    for blank in ("", "  ", "sk-k3\n"):  # keys no client can send
        with pytest.raises(ValueError, match="api_key"):
            build_app(s.engine, byte_tokenizer(), NAME, api_key=blank)


def test_full_queue_is_503_with_retry_after(checkpoint):
    with start(CausalLM.from_pretrained(checkpoint).eval(), max_queue=1, max_running=1, max_model_len=4096) as s:
        long = json.dumps({"model": NAME, "prompt": "Hi", "max_tokens": 4000, "ignore_eos": True, "stream": True})
        conns = []
        # one running (one slot), then one waiting: each sent once the engine has taken the one
        # before, or the second would find the first still queued and be the one turned away
        for want in ((1, 0), (1, 1)):
            conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
            conn.request("POST", "/v1/completions", long, {"Content-Type": "application/json"})
            conns.append(conn)
            deadline = time.time() + 30
            while (s.engine.stats()["running"], s.engine.stats()["waiting"]) != want:
                assert time.time() < deadline, (want, s.engine.stats())
                time.sleep(0.01)
        code, out, headers = post(s, "/v1/completions", long)
        assert code == 503 and headers.get("retry-after") == "1" and "waiting" in out["error"]["message"]
        for conn in conns:
            conn.sock.shutdown(2)
            conn.close()
        wait_idle(s)


class SlowTokenizer:
    """The byte tokenizer, 2 s to encode: /health must answer meanwhile."""

    def __init__(self):
        self.inner = byte_tokenizer()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, text):
        time.sleep(2)
        return self.inner.encode(text)

    def encode_batch(self, texts):  # what the app calls (k3's tokenizer releases the GIL there)
        time.sleep(2)
        return self.inner.encode_batch(texts)


def test_tokenizing_does_not_block_health(checkpoint):
    engine = Engine(CausalLM.from_pretrained(checkpoint).eval(), cache_memory=10**9, max_running=8, max_length=512)
    with ServerThread(build_app(engine, SlowTokenizer(), NAME), engine) as s:
        thread = threading.Thread(
            target=post, args=(s, "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2}))
        )
        thread.start()
        time.sleep(0.3)
        t0 = time.time()
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200 and time.time() - t0 < 1.0
        thread.join(30)


def test_draining_answers_503_with_retry_after(checkpoint):
    """After SIGTERM (uvicorn's handle_exit) the server still listens: new requests get 503 with
    Retry-After while the running one finishes; then it exits."""
    model = CausalLM.from_pretrained(checkpoint).eval()
    forward = model.model.forward  # the decoder, which prefill and the decode step both run
    # each turn at least 10 ms: the running request (100 turns) must outlast the 0.5 s below on a fast machine
    model.model.forward = lambda *args, **kwargs: (time.sleep(0.01), forward(*args, **kwargs))[1]
    engine = Engine(model, cache_memory=10**9, max_running=8, max_length=512)
    with ServerThread(build_app(engine, byte_tokenizer(), NAME), engine, shutdown_timeout=60) as s:
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps({"prompt": "Hi", "max_tokens": 100, "ignore_eos": True}),
            {"Content-Type": "application/json"},
        )
        deadline = time.time() + 30
        while s.engine.stats()["running"] == 0:
            assert time.time() < deadline
            time.sleep(0.01)
        s._server.handle_exit(signal.SIGTERM, None)
        time.sleep(0.5)  # several of uvicorn's ticks: it would have closed its socket by now
        code, out, headers = post(s, "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2}))
        assert code == 503 and headers.get("retry-after") and out["error"]["type"] == "server_busy", out
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 100
        s._thread.join(30)
        assert not s._thread.is_alive()


def test_the_prefix_cache_gives_the_same_text_over_http(checkpoint):
    """Chat-like requests sharing a 300-token system prompt (blocks of 64 tokens), served with the prefix
    cache on and off: the same greedy text and the same seeded samples, and /health counts the hits."""
    model = CausalLM.from_pretrained(checkpoint).eval()
    system = "You are a terse assistant who answers in verse. " * 6  # 300 bytes: 300 tokens
    prompts = [system + question for question in ("Why?", "What is a state?", "Why?", "Name a delta rule.")]
    answers = {}
    for on in (True, False):
        with start(model, prefix_cache=on, prefill_chunk=64) as s:
            client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
            answers[on] = [
                client.completions.create(model=NAME, prompt=p, max_tokens=8, temperature=t, seed=3).choices[0].text
                for p in prompts
                for t in (0, 0.8)
            ]
            health = wait_idle(s)
            if on:
                assert health["prefix_cache"]["hits"] == len(prompts) - 1 + len(prompts)  # every request but the first
                assert health["prefix_cache"]["hit_tokens"] >= 4 * 64 * (2 * len(prompts) - 1)
            else:
                assert health["prefix_cache"] is None
    assert answers[True] == answers[False]


def streamed_chunks(server, body: dict) -> list[dict]:
    """The JSON chunks of one streamed /v1/completions answer, [DONE] left out."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    lines = conn.getresponse().read().decode().splitlines()
    conn.close()
    assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def test_stream_interval_sends_the_first_token_then_every_n(checkpoint):
    """`stream_interval` 4: the first token's text at once, then an event every 4 tokens, the rest with the
    finish: the same text as every token's own event, in fewer events; usage counts every token."""
    model = CausalLM.from_pretrained(checkpoint).eval()
    body = {
        "prompt": "Hello",
        "max_tokens": 14,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"continuous_usage_stats": True},
    }
    texts, counts = {}, {}
    for interval in (1, 4):
        with start(model, stream_interval=interval) as s:
            chunks = streamed_chunks(s, body)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 14
        chunks = chunks[:-1]
        texts[interval] = "".join(c["choices"][0]["text"] for c in chunks)
        counts[interval] = [c["usage"]["completion_tokens"] for c in chunks if c["choices"][0]["text"]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert texts[4] == texts[1] and len(texts[1]) > 0
    assert len(counts[1]) >= 8, counts  # the byte tokenizer holds back only a character's unfinished bytes
    gaps = [b - a for a, b in zip(counts[4], counts[4][1:])]
    assert all(gap >= 4 for gap in gaps[:-1]) and len(counts[4]) <= 1 + -(-13 // 4), counts[4]
    with pytest.raises(ValueError, match="stream_interval"):
        build_app(Engine(model, cache_memory=10**8, max_length=64), byte_tokenizer(), NAME, stream_interval=0)


class Records(logging.Handler):
    """The records a logger (and its children) gets, kept: uvicorn's loggers do not reach pytest's caplog."""

    def __init__(self, name: str):
        super().__init__()
        self.logger, self.records = logging.getLogger(name), []

    def emit(self, record):
        self.records.append(record)

    def __enter__(self) -> "Records":
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)


def slowed(checkpoint, wedge: threading.Event | None = None, release: threading.Event | None = None):
    """The checkpoint's model, each forward at least 10 ms (a request of 400 tokens runs for seconds); once
    `wedge` is set, every forward waits for `release` (an engine stuck in a step)."""
    model = CausalLM.from_pretrained(checkpoint).eval()
    forward = model.model.forward

    def slow(*args, **kwargs):
        if wedge is not None and wedge.is_set():
            release.wait(60)
        time.sleep(0.01)
        return forward(*args, **kwargs)

    model.model.forward = slow
    return model


@pytest.mark.parametrize("how", ["timeout", "second signal, engine stuck"])
def test_a_stopping_server_ends_every_request_cleanly(checkpoint, how):
    """SIGTERM, then --shutdown-timeout running out or a second SIGTERM: a running stream gets a last
    chunk with finish_reason "abort" and `data: [DONE]`, a request waiting for its whole answer a 503 in
    OpenAI's shape, and nothing is logged with a traceback; the server exits. With the engine stuck in a
    forward the app ends the requests itself."""
    wedge, release = threading.Event(), threading.Event()
    engine = Engine(slowed(checkpoint, wedge, release), cache_memory=10**9, max_running=8, max_length=512)
    timeout = 0.5 if how == "timeout" else 60
    s = ServerThread(build_app(engine, byte_tokenizer(), NAME), engine, shutdown_timeout=timeout, log_level="info")
    try:
        with Records("uvicorn") as log:
            stream = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
            body = {"prompt": "Hi", "max_tokens": 400, "ignore_eos": True}
            stream.request(
                "POST", "/v1/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"}
            )
            r = stream.getresponse()
            assert r.status == 200 and r.readline().startswith(b"data: {")
            whole = {}
            waiting = threading.Thread(target=lambda: whole.update(answer=post(s, "/v1/completions", json.dumps(body))))
            waiting.start()
            deadline = time.time() + 30
            while s.engine.stats()["running"] < 2:
                assert time.time() < deadline
                time.sleep(0.01)
            if how != "timeout":
                wedge.set()
            s._server.handle_exit(signal.SIGTERM, None)
            if how != "timeout":
                time.sleep(0.3)
                s._server.handle_exit(signal.SIGTERM, None)
            lines = [line for line in r.read().decode().splitlines() if line]
            waiting.join(30)
            release.set()
            s._thread.join(30)
            assert not s._thread.is_alive()
        assert lines[-1] == "data: [DONE]", lines[-3:]
        last = json.loads(lines[-2][len("data: ") :])
        assert last["choices"][0]["finish_reason"] == "abort", last
        code, out, headers = whole["answer"]
        assert code == 503 and out["error"]["type"] == "server_busy" and out["error"]["code"] == 503, out
        assert headers.get("retry-after") == "1"
        logged = [record.getMessage() for record in log.records if record.levelno >= logging.ERROR or record.exc_info]
        assert not logged, logged
    finally:
        release.set()
        s.stop()


def test_sighup_drains_like_sigterm(checkpoint):
    """A closed terminal's SIGHUP, to `serve` on the main thread: the server drains (a new request gets
    503) while the running request finishes whole, and `serve` returns (SIGHUP no longer ends the process
    mid-answer). A watchdog's SIGTERM stops a server that ignored it."""
    engine = Engine(slowed(checkpoint), cache_memory=10**9, max_running=8, max_length=512)
    app = build_app(engine, byte_tokenizer(), NAME)
    ports, results = queue.Queue(), {}

    def client():
        port = ports.get(timeout=60)
        here = SimpleNamespace(port=port)
        body = json.dumps({"prompt": "Hi", "max_tokens": 100, "ignore_eos": True})
        running = threading.Thread(target=lambda: results.update(running=post(here, "/v1/completions", body)))
        running.start()
        deadline = time.time() + 30
        while engine.stats()["running"] == 0 and time.time() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(0.3)
        results["new"] = post(here, "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2}))
        running.join(60)

    thread = threading.Thread(target=client)
    watchdog = threading.Timer(30, lambda: os.kill(os.getpid(), signal.SIGTERM))
    # a SIGHUP that `serve` does not handle comes here (not to the default, which ends pytest)
    previous = signal.signal(signal.SIGHUP, lambda *_: results.update(unhandled=True))
    thread.start()
    watchdog.start()
    try:
        serve(app, engine, port=0, shutdown_timeout=60, log_level="warning", on_ready=ports.put)
    finally:
        watchdog.cancel()
        signal.signal(signal.SIGHUP, previous)
    thread.join(30)
    assert "unhandled" not in results, "serve did not handle SIGHUP"
    assert results["new"][0] == 503 and results["new"][1]["error"]["type"] == "server_busy", results["new"]
    code, out, _ = results["running"]
    assert code == 200 and out["usage"]["completion_tokens"] == 100, out
