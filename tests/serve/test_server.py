"""`k3 serve` over HTTP, with the official `openai` client against a server on a free local port: the same
greedy text as `k3 generate`, streaming or not; concurrent requests each as alone; a disconnect frees its
slot; every bad input answered with a status and a message naming the field."""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time

import openai
import pytest
import torch

from k3.cli import main
from k3.models import CausalLM, get_config
from k3.serve import Engine, ServerThread, build_app
from k3.serve.text import chat_prompt
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
    engine = Engine(model, cache_memory=kw.pop("cache_memory", 10**9), max_queue=kw.pop("max_queue", 256))
    return ServerThread(build_app(engine, byte_tokenizer(), NAME, **kw), engine)


@pytest.fixture(scope="module")
def server(checkpoint):
    with start(CausalLM.from_pretrained(checkpoint).eval(), max_model_len=512) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def generated(capsys, checkpoint, prompt: str, n: int) -> str:
    """`k3 generate`'s greedy continuation of `prompt` (what it prints after the prompt)."""
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(checkpoint), "--prompt", prompt, "--max-new-tokens", str(n),
                 "--temperature", "0"]) == 0
    return capsys.readouterr().out[len(prompt):-1]  # less the prompt and the closing newline


def post(server, path: str, body: bytes | str, headers: dict | None = None) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", path, body.encode() if isinstance(body, str) else body,
                 {"Content-Type": "application/json", **(headers or {})})
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
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_stop_n_seed_and_models(client):
    r = client.completions.create(model=NAME, prompt="Hello", max_tokens=12, temperature=0)
    text = r.choices[0].text
    stop = text[3:5]
    cut = client.completions.create(model=NAME, prompt="Hello", max_tokens=12, temperature=0, stop=stop)
    assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"
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
    expected = [tok.decode(model.generate([tok.encode(t)], n, temperature=0, eos_token_id=tok.eot_id)[0]
                           [len(tok.encode(t)):].tolist()) for t, n in zip(texts, lengths)]
    with start(model) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        results = [None] * 16

        def ask(i):
            results[i] = client.completions.create(model=NAME, prompt=texts[i], max_tokens=lengths[i],
                                                   temperature=0).choices[0].text

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
    conn.request("POST", "/v1/completions", json.dumps({"model": NAME, "prompt": "Hi", "max_tokens": 500,
                                                        "ignore_eos": True, "stream": stream}),
                 {"Content-Type": "application/json"})
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


BAD = [
    ('{"model": "tiny", "prompt": "hi"', 400, "body", "not valid JSON"),
    ('{"model": "tiny", "prompt": "hi", "colour": 1}', 400, "colour", "Extra inputs"),
    ('{"model": "tiny", "prompt": "hi", "max_tokens": 0}', 400, "max_tokens", "greater than 0"),
    ('{"model": "tiny", "prompt": "hi", "max_tokens": -3}', 400, "max_tokens", "greater than 0"),
    ('{"model": "tiny", "prompt": "hi", "temperature": "warm"}', 400, "temperature", "number"),
    ('{"model": "tiny", "prompt": ""}', 400, "prompt", "empty"),
    ('{"model": "tiny", "prompt": [300]}', 400, "prompt", "vocabulary"),
    ('{"model": "tiny", "prompt": "' + "x" * 600 + '"}', 400, "prompt", "at most 512"),
    ('{"model": "tiny", "prompt": "hi", "max_tokens": 600}', 400, "max_tokens", "at most 511"),
    ('{"model": "other", "prompt": "hi"}', 404, "model", "not served"),
    ('{"model": "tiny"}', 400, "prompt", "Field required"),
]


@pytest.mark.parametrize("body,status,param,words", BAD)
def test_bad_input(server, body, status, param, words):
    code, out, _ = post(server, "/v1/completions", body)
    assert code == status and out["error"]["param"] == param and words in out["error"]["message"], out


def test_bad_chat_and_body(server):
    code, out, _ = post(server, "/v1/chat/completions",
                        '{"model": "tiny", "messages": [{"role": "bot", "content": "x"}]}')
    assert code == 400 and out["error"]["param"] == "messages.0.role"
    code, out, _ = post(server, "/v1/chat/completions", '{"model": "tiny", "messages": []}')
    assert code == 400 and out["error"]["param"] == "messages"
    code, out, _ = post(server, "/v1/completions", b'{"model": "tiny", "prompt": "h\xff\xfe"}')
    assert code == 400 and out["error"]["param"] == "body" and "UTF-8" in out["error"]["message"]


def test_api_key(checkpoint):
    with start(CausalLM.from_pretrained(checkpoint).eval(), api_key="sk-k3") as s:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="sk-k3", max_retries=0)
        assert good.completions.create(model=NAME, prompt="a", max_tokens=2).usage.completion_tokens == 2
        conn = http.client.HTTPConnection("127.0.0.1", s.port)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200  # health needs no key


def test_full_queue_is_503_with_retry_after(checkpoint):
    with start(CausalLM.from_pretrained(checkpoint).eval(), max_queue=1, cache_memory=2 * 10**6) as s:
        long = json.dumps({"model": NAME, "prompt": "Hi", "max_tokens": 4000, "ignore_eos": True, "stream": True})
        conns = []
        # one running (the budget holds one), then one waiting: each sent once the engine has taken the one
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


def chat_in_background(server, count: int, max_tokens: int = 40) -> tuple[list, list]:
    """`count` greedy chat requests on threads; (threads, results): each result (status, body) once done."""
    results = [None] * count

    def ask(i):
        body = {"model": NAME, "messages": [{"role": "user", "content": f"Hi {i}"}], "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True}
        code, out, _ = post(server, "/v1/chat/completions", json.dumps(body))
        results[i] = (code, out)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    return threads, results


POISON = [{"seed": 2**64}, {"seed": -1}, {"seed": 10**30}, {"top_p": 1e-300}, {"temperature": 5e-324},
          {"temperature": 1e-300, "top_p": 5e-324}, {"top_k": 0}, {"n": 2, "seed": 2**64 - 1}]


def three_chats_running(server):
    """Three chat requests started on threads, returned once the engine runs all three."""
    threads, results = chat_in_background(server, 3)
    deadline = time.time() + 30
    while server.engine.stats()["running"] < 3:
        assert time.time() < deadline
        time.sleep(0.005)
    return threads, results


@pytest.mark.parametrize("poison", POISON, ids=[json.dumps(p) for p in POISON])
def test_a_poisoned_request_does_not_fail_the_others(server, poison):
    """Three chat requests decode; a completion with an out-of-range or extreme sampling setting arrives:
    it is answered (400 naming the field, or 200: extreme settings in range sample finitely), and the
    three get their normal answers."""
    expected = [post(server, "/v1/chat/completions", json.dumps(
        {"model": NAME, "messages": [{"role": "user", "content": f"Hi {i}"}], "max_tokens": 40, "temperature": 0,
         "ignore_eos": True}))[1]["choices"][0]["message"]["content"] for i in range(3)]
    threads, results = three_chats_running(server)
    code, out, _ = post(server, "/v1/completions", json.dumps({"model": NAME, "prompt": "Hi", "max_tokens": 4,
                                                               "temperature": 1, **poison}))
    if code == 400:
        assert out["error"]["param"] in poison and out["error"]["type"] == "invalid_request_error", out
    else:
        assert code == 200 and out["usage"]["completion_tokens"] >= 1, out
    for t in threads:
        t.join(60)
    assert [r[0] for r in results] == [200] * 3, results
    assert [r[1]["choices"][0]["message"]["content"] for r in results] == expected


def test_a_request_whose_sampling_raises_fails_alone(server, monkeypatch, caplog):
    """A failure while sampling one request's row (bypassing validation: a patched `sample`) ends that
    request with a 500 in OpenAI's shape and a line in the log; the requests beside it are unharmed."""
    import k3.serve.engine as engine_module

    real = engine_module.sample

    def poisoned(logits, temperature, *args, **kw):
        if temperature == 0.777:
            raise RuntimeError("poisoned row")
        return real(logits, temperature, *args, **kw)

    monkeypatch.setattr(engine_module, "sample", poisoned)
    threads, results = three_chats_running(server)
    code, out, _ = post(server, "/v1/completions", json.dumps({"model": NAME, "prompt": "Hi", "max_tokens": 4,
                                                               "temperature": 0.777}))
    assert code == 500 and out["error"]["type"] == "server_error" and "poisoned row" in out["error"]["message"]
    for t in threads:
        t.join(60)
    assert [r[0] for r in results] == [200] * 3, results
    assert all(r[1]["usage"]["completion_tokens"] == 40 for r in results)
    assert "poisoned row" in caplog.text


TYPES = [
    ('{"model": "tiny", "prompt": "hi", "stream": "yes"}', "stream"),
    ('{"model": "tiny", "prompt": "hi", "max_tokens": "5"}', "max_tokens"),
    ('{"model": "tiny", "prompt": "hi", "temperature": true}', "temperature"),
    ('{"model": "tiny", "prompt": "hi", "temperature": NaN}', "temperature"),
    ('{"model": "tiny", "prompt": "hi", "top_p": Infinity}', "top_p"),
    ('{"model": "tiny", "prompt": "hi", "n": 1.5}', "n"),
    ('{"model": "tiny", "prompt": "hi", "seed": "7"}', "seed"),
    ('{"model": "tiny", "prompt": [1, 2.5]}', "prompt"),
    ('{"model": "tiny", "prompt": "\\ud800"}', "prompt"),
    ('{"model": "tiny", "prompt": "hi", "stop": ["\\udfff"]}', "stop"),
    ('{"model": "tiny", "prompt": "hi", "\\ud800": 1}', "body"),  # a key no field has, and not text
    ('{"model": "\\ud800", "prompt": "hi"}', "model"),
    ('[1, 2]', "body"),
    ('{"prompt": ' + "[" * 5000 + "]" * 5000 + "}", "body"),  # nested past json's recursion limit
    ('{"prompt": "hi", "seed": ' + "9" * 5000 + "}", "body"),  # past Python's digits limit for an int
    ('{"prompt": "hi", "stop": ' + json.dumps(["x"] * 17) + "}", "stop"),
    ('{"prompt": ' + json.dumps([[1]] * 100) + ', "n": 16}', "prompt"),  # more sequences than --max-queue
]


@pytest.mark.parametrize("body,param", TYPES)
def test_wrong_types_and_lone_surrogates_are_400(server, body, param):
    code, out, _ = post(server, "/v1/completions", body)
    assert code == 400 and out["error"]["type"] == "invalid_request_error", (code, out)
    assert out["error"]["param"].split(".")[0] == param and out["error"]["code"] == 400, out


def test_unknown_path_and_method_in_openai_shape(server):
    code, out, _ = post(server, "/v1/engines", "{}")
    assert code == 404 and out["error"]["type"] == "invalid_request_error" and "/v1/engines" in out["error"]["message"]
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/v1/completions")
    r = conn.getresponse()
    assert r.status == 405 and json.loads(r.read())["error"]["code"] == 405


def test_a_lone_surrogate_in_a_chat_message_is_400(server):
    code, out, _ = post(server, "/v1/chat/completions",
                        '{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}')
    assert code == 400 and out["error"]["param"] == "messages.0.content", out


def test_request_size_limits_are_413(checkpoint):
    with start(CausalLM.from_pretrained(checkpoint).eval(), max_request_bytes=1000, max_prompt_tokens=50) as s:
        code, out, _ = post(s, "/v1/completions", json.dumps({"model": NAME, "prompt": "x" * 2000}))
        assert code == 413 and out["error"]["param"] == "body" and "1,000" in out["error"]["message"], out
        code, out, _ = post(s, "/v1/completions", json.dumps({"model": NAME, "prompt": "x" * 60}))
        assert code == 413 and out["error"]["param"] == "prompt" and "50" in out["error"]["message"], out
        code, out, _ = post(s, "/v1/chat/completions", json.dumps(
            {"model": NAME, "messages": [{"role": "user", "content": "x" * 60}]}))
        assert code == 413 and out["error"]["param"] == "messages", out
        code, out, _ = post(s, "/v1/completions", json.dumps({"model": NAME, "prompt": "x" * 10, "max_tokens": 2}))
        assert code == 200, out


class SlowTokenizer:
    """The byte tokenizer, 2 s to encode: /health must answer meanwhile."""

    def __init__(self):
        self.inner = byte_tokenizer()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, text):
        time.sleep(2)
        return self.inner.encode(text)


def test_tokenizing_does_not_block_health(checkpoint):
    engine = Engine(CausalLM.from_pretrained(checkpoint).eval(), cache_memory=10**9)
    with ServerThread(build_app(engine, SlowTokenizer(), NAME), engine) as s:
        thread = threading.Thread(target=post, args=(s, "/v1/completions", json.dumps({"prompt": "Hi",
                                                                                       "max_tokens": 2})))
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
    engine = Engine(CausalLM.from_pretrained(checkpoint).eval(), cache_memory=10**9)
    with ServerThread(build_app(engine, byte_tokenizer(), NAME), engine, shutdown_timeout=60) as s:
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 100, "ignore_eos": True}),
                     {"Content-Type": "application/json"})
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
