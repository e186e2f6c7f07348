"""`k3 serve`'s answers to bad input over HTTP: every bad body answered 400 (404 for another model, 413 past
a size limit) with OpenAI's error body naming the field; a request with extreme or failing sampling fails
alone, the requests beside it unharmed; a request that does not arrive in time is 408, connections past the
bound 503."""

from __future__ import annotations

import gzip
import http.client
import json
import re
import socket
import threading
import time
import unittest

import pytest

from k3.models import CausalLM
from k3.serve import Engine, ServerThread, build_app
from k3.tokenizer import byte_tokenizer

from .conftest import NAME, poison_sampling, post, start

BAD = [
    ('{"model": "tiny", "prompt": "hi"', 400, "body", "not valid JSON"),
    ('{"model": "tiny", "prompt": "hi", "colour": 1}', 400, "colour", "Extra inputs"),
    ('{"model": "tiny", "prompt": "hi", "max_tokens": 0}', 400, "max_tokens", "greater than 0"),
    ('{"model": "tiny", "prompt": "hi", "max_tokens": -3}', 400, "max_tokens", "greater than 0"),
    ('{"model": "tiny", "prompt": "hi", "temperature": "warm"}', 400, "temperature", "number"),
    ('{"model": "tiny", "prompt": "hi", "temperature": NaN}', 400, "temperature", "finite number"),
    ('{"model": "tiny", "prompt": "hi", "top_p": -Infinity}', 400, "top_p", "finite number"),
    ('{"model": "tiny", "prompt": ""}', 400, "prompt", "empty"),
    ('{"model": "tiny", "prompt": [300]}', 400, "prompt", "vocabulary"),
    ('{"model": "tiny", "prompt": "' + "x" * 600 + '"}', 400, "prompt", "takes 512 tokens at most"),
    ('{"model": "tiny", "prompt": "hi", "max_tokens": 600}', 400, "max_tokens", "600 tokens; this model takes 512"),
    ('{"model": "other", "prompt": "hi"}', 404, "model", "not served"),
    ('{"model": "tiny"}', 400, "prompt", "Field required"),
    ('{"model": "tiny", "prompt": "hi", "stop": ["ab", ""]}', 400, "stop", "an empty stop string"),
    ('{"model": "tiny", "prompt": "hi", "stop": ""}', 400, "stop", "an empty stop string"),
    ('{"prompt": "hi", "stream_options": {"include_usage": true}}', 400, "stream_options", 'with "stream": true'),
    ('{"prompt": "hi", "stream": false, "stream_options": {}}', 400, "stream_options", 'with "stream": true'),
]


@pytest.mark.parametrize("body,status,param,words", BAD)
def test_bad_input(server, body, status, param, words):
    code, out, _ = post(server, "/v1/completions", body)
    assert code == status and out["error"]["param"] == param and words in out["error"]["message"], out


def test_bad_chat_and_body(server):
    code, out, _ = post(
        server, "/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "bot", "content": "x"}]}'
    )
    assert code == 400 and out["error"]["param"] == "messages.0.role"
    code, out, _ = post(server, "/v1/chat/completions", '{"model": "tiny", "messages": []}')
    assert code == 400 and out["error"]["param"] == "messages"
    hi = [{"role": "user", "content": "hi"}]
    both = {"messages": hi, "max_tokens": 5, "max_completion_tokens": 3, "ignore_eos": True}
    code, out, _ = post(server, "/v1/chat/completions", json.dumps(both))  # the newer name wins, as in vLLM
    assert code == 200 and out["usage"]["completion_tokens"] == 3, out
    code, out, _ = post(server, "/v1/completions", b'{"model": "tiny", "prompt": "h\xff\xfe"}')
    assert code == 400 and out["error"]["param"] == "body" and "UTF-8" in out["error"]["message"]


def chat_in_background(server, count: int, max_tokens: int = 40) -> tuple[list, list]:
    """`count` greedy chat requests on threads; (threads, results): each result (status, body) once done."""
    results = [None] * count

    def ask(i):
        body = {
            "model": NAME,
            "messages": [{"role": "user", "content": f"Hi {i}"}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        code, out, _ = post(server, "/v1/chat/completions", json.dumps(body))
        results[i] = (code, out)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    return threads, results


POISON = [
    {"seed": 2**64},
    {"seed": -1},
    {"seed": 10**30},
    {"top_p": 1e-300},
    {"temperature": 5e-324},
    {"temperature": 1e-300, "top_p": 5e-324},
    {"top_k": 0},
    {"n": 2, "seed": 2**64 - 1},
]


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
    expected = [
        post(
            server,
            "/v1/chat/completions",
            json.dumps(
                {
                    "model": NAME,
                    "messages": [{"role": "user", "content": f"Hi {i}"}],
                    "max_tokens": 40,
                    "temperature": 0,
                    "ignore_eos": True,
                }
            ),
        )[1]["choices"][0]["message"]["content"]
        for i in range(3)
    ]
    threads, results = three_chats_running(server)
    code, out, _ = post(
        server,
        "/v1/completions",
        json.dumps({"model": NAME, "prompt": "Hi", "max_tokens": 4, "temperature": 1, **poison}),
    )
    if code == 400:
        assert out["error"]["param"] in poison and out["error"]["type"] == "invalid_request_error", out
    else:
        assert code == 200 and out["usage"]["completion_tokens"] >= 1, out
    for t in threads:
        t.join(60)
    assert [r[0] for r in results] == [200] * 3, results
    assert [r[1]["choices"][0]["message"]["content"] for r in results] == expected


def test_a_request_whose_sampling_raises_fails_alone(server, monkeypatch, caplog):
    """A failure while sampling one request's row (bypassing validation: a patched `sample_turn`, for any
    draw that holds it) ends that request with a 500 in OpenAI's shape and a line in the log; the requests
    beside it are unharmed."""
    poison_sampling(monkeypatch, lambda s: s.temperature == 0.777, "poisoned row")
    threads, results = three_chats_running(server)
    code, out, _ = post(
        server, "/v1/completions", json.dumps({"model": NAME, "prompt": "Hi", "max_tokens": 4, "temperature": 0.777})
    )
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
    ("[1, 2]", "body"),
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


NOT_JSON = [
    ("text/plain", '{"prompt": "hi"}', "'text/plain'"),
    ("application/x-www-form-urlencoded", "prompt=hi&max_tokens=2", "'application/x-www-form-urlencoded'"),
    ("multipart/form-data; boundary=x", "--x--", "multipart/form-data"),
    (None, '{"prompt": "hi"}', "no Content-Type"),
]


@pytest.mark.parametrize("content_type,body,named", NOT_JSON, ids=[str(c[0]) for c in NOT_JSON])
def test_a_body_not_sent_as_json_is_415(server, content_type, body, named):
    """A text, form or multipart body (FastAPI parses only JSON, and answered "Input should be a valid
    dictionary"): 415 naming the Content-Type sent and the one taken."""
    for path in ("/v1/completions", "/v1/chat/completions"):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("POST", path, body.encode(), {} if content_type is None else {"Content-Type": content_type})
        r = conn.getresponse()
        out = json.loads(r.read())
        message = out["error"]["message"]
        assert r.status == 415 and out["error"]["param"] == "body" and out["error"]["code"] == 415, out
        assert named in message and "application/json" in message, message


def test_a_compressed_body_is_415(server):
    """A body sent with Content-Encoding gzip (or br, or any but identity) was read as its bytes: "not
    UTF-8", or a plain body under that header answered as if it were not there."""
    plain = b'{"prompt": "hi", "max_tokens": 2}'
    for encoding, body in (("gzip", gzip.compress(plain)), ("br", plain)):
        code, out, _ = post(server, "/v1/completions", body, {"Content-Encoding": encoding})
        assert code == 415 and out["error"]["param"] == "body", (code, out)
        assert f"Content-Encoding '{encoding}'" in out["error"]["message"], out
    assert post(server, "/v1/completions", plain, {"Content-Encoding": "identity"})[0] == 200


@pytest.mark.parametrize("body,kind", [("[1, 2]", "array"), ('"hi"', "string"), ("7", "number"), ("null", "null")])
def test_json_that_is_not_an_object_is_400(server, body, kind):
    code, out, _ = post(server, "/v1/completions", body, {"Content-Type": "application/json; charset=utf-8"})
    assert code == 400 and out["error"]["param"] == "body" and f"a JSON {kind} was sent" in out["error"]["message"]


def test_unknown_path_and_method_in_openai_shape(server):
    code, out, _ = post(server, "/v1/engines", "{}")
    assert code == 404 and out["error"]["type"] == "invalid_request_error" and "/v1/engines" in out["error"]["message"]
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/v1/completions")
    r = conn.getresponse()
    assert r.status == 405 and json.loads(r.read())["error"]["code"] == 405


def test_a_lone_surrogate_in_a_chat_message_is_400(server):
    code, out, _ = post(
        server, "/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}'
    )
    assert code == 400 and out["error"]["param"] == "messages.0.content", out


def test_request_size_limits_are_413(checkpoint):
    with start(CausalLM.from_pretrained(checkpoint).eval(), max_request_bytes=1000, max_prompt_tokens=50) as s:
        code, out, _ = post(s, "/v1/completions", json.dumps({"model": NAME, "prompt": "x" * 2000}))
        assert code == 413 and out["error"]["param"] == "body" and "1,000" in out["error"]["message"], out
        code, out, _ = post(s, "/v1/completions", json.dumps({"model": NAME, "prompt": "x" * 60}))
        assert code == 413 and out["error"]["param"] == "prompt" and "50" in out["error"]["message"], out
        code, out, _ = post(
            s, "/v1/chat/completions", json.dumps({"model": NAME, "messages": [{"role": "user", "content": "x" * 60}]})
        )
        assert code == 413 and out["error"]["param"] == "messages", out
        code, out, _ = post(s, "/v1/completions", json.dumps({"model": NAME, "prompt": "x" * 10, "max_tokens": 2}))
        assert code == 200, out


def answer_of(sock: socket.socket) -> tuple[int, dict, bytes]:
    """(status, JSON body, what follows) of the one answer a raw socket gets, read until the server closes."""
    sock.settimeout(30)  # a server that never answers fails here
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
    return int(head.split()[1]), json.loads(body[:length]), body[length:]


def test_requests_that_do_not_arrive_are_408_and_connections_are_bounded(checkpoint):
    """Real sockets against a server with a 1 s deadline for a request to arrive and 4 connections at
    most: a body that stops short, a head that stops short, a connection that sends nothing, and a head
    trickled a byte at a time (the deadline runs from the first byte; more bytes do not extend it) are each
    answered 408 in OpenAI's shape and closed; a kept-alive connection's second request has its own
    deadline; a fifth connection beside four open ones is answered 503 with Retry-After; a request that
    arrived whole may take longer than the deadline to answer; nothing is logged as an error."""
    engine = Engine(CausalLM.from_pretrained(checkpoint).eval(), cache_memory=10**9, max_running=8, max_length=512)
    app = build_app(engine, byte_tokenizer(), NAME)
    # uvicorn sets its loggers up as the server is made: what they log is watched from then on
    with ServerThread(app, engine, request_timeout=1.0, max_connections=4) as s:
        with unittest.TestCase().assertNoLogs("uvicorn", "ERROR"):

            def connect(data: bytes = b"") -> socket.socket:
                sock = socket.create_connection(("127.0.0.1", s.port))
                sock.sendall(data)
                return sock

            head = b"POST /v1/completions HTTP/1.1\r\nHost: k3\r\nContent-Type: application/json\r\n"
            status, out, _ = answer_of(connect(head + b'Content-Length: 100\r\n\r\n{"prompt"'))
            assert status == 408 and out["error"]["param"] == "body" and "--request-timeout" in out["error"]["message"]
            status, out, _ = answer_of(connect(head))
            assert status == 408 and out["error"]["param"] is None and "request head" in out["error"]["message"], out
            assert answer_of(connect())[0] == 408
            trickle = connect()
            for byte in head:
                try:
                    trickle.sendall(bytes([byte]))
                except OSError:  # closed after its 408
                    break
                time.sleep(0.05)
            status, out, _ = answer_of(trickle)
            assert status == 408 and out["error"]["code"] == 408
            kept = connect(b"GET /health HTTP/1.1\r\nHost: k3\r\n\r\n")
            kept.settimeout(30)
            assert kept.recv(65536).startswith(b"HTTP/1.1 200")
            kept.sendall(head)
            status, _, _ = answer_of(kept)
            assert status == 408

            held = [connect(head) for _ in range(4)]
            status, out, _ = answer_of(connect())
            assert (
                status == 503
                and out["error"]["type"] == "server_busy"
                and "--max-connections" in out["error"]["message"]
            )
            for sock in held:
                assert answer_of(sock)[0] == 408

            # a whole request, longer to answer than the deadline
            forward = engine.model.model.forward
            engine.model.model.forward = lambda *a, **k: (time.sleep(0.02), forward(*a, **k))[1]
            code, out, _ = post(
                s, "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 80, "ignore_eos": True})
            )
            assert code == 200 and out["usage"]["completion_tokens"] == 80


@pytest.mark.parametrize(
    "refusal, field",
    [
        ("the sequence's 5 prompt tokens and max_tokens 900 are 905 tokens, more than the 512 a ...", "max_tokens"),
        ("the prefill of the sequence's 400 prompt tokens needs 9,999 bytes, more than the 10 ...", "prompt"),
        ("Engine.submit: sequence 3 was submitted before (length): make a new one", None),
    ],
)
def test_the_engines_refusal_names_the_field_behind_it(server, monkeypatch, refusal, field):
    def refuse(sequence):
        raise ValueError(refusal)

    monkeypatch.setattr(server.engine, "submit", refuse)
    status, out, _ = post(server, "/v1/completions", json.dumps({"model": NAME, "prompt": "to be", "max_tokens": 4}))
    assert status == 400 and out["error"]["param"] == field
    assert out["error"]["message"] == (f"{field}: {refusal}" if field else refusal)


def test_a_refused_request_leaves_its_reason_in_the_log(server, caplog):
    with caplog.at_level("WARNING", logger="k3.serve"):
        status, _, _ = post(server, "/v1/completions", json.dumps({"prompt": "x", "temperature": -1}))
    assert status == 400
    assert "refused (400): temperature: Input should be greater than or equal to 0" in caplog.text


def test_a_chat_templates_failure_is_the_servers_and_its_refusal_the_clients(checkpoint, caplog):
    """The checkpoint's template refusing a conversation (its raise_exception) is 400 naming messages; the
    template failing on one (here: a message it expects that is not there) is 500 naming the template."""
    template = (
        "{% if messages[0].role == 'system' %}{{ raise_exception('no system messages') }}{% endif %}"
        "{{ messages[1].content.upper() }}"
    )

    def chat(*roles):
        messages = [{"role": role, "content": "hi"} for role in roles]
        return post(s, "/v1/chat/completions", json.dumps({"messages": messages, "max_tokens": 2}))

    with start(CausalLM.from_pretrained(checkpoint).eval(), chat_template=template) as s:
        status, out, _ = chat("system", "user")
        assert status == 400 and out["error"]["param"] == "messages", out
        assert "refused the conversation: no system messages" in out["error"]["message"]
        with caplog.at_level("ERROR", logger="k3.serve"):
            status, out, _ = chat("user")
        assert status == 500 and out["error"]["type"] == "server_error" and out["error"]["param"] is None, out
        assert "the server's chat template failed on this conversation: UndefinedError" in out["error"]["message"]
        assert "UndefinedError" in caplog.text  # and its traceback, for the one who serves it
        status, out, _ = chat("user", "assistant")
        assert status == 200, out


def test_a_chat_template_that_is_not_jinja_is_refused_by_build_app(checkpoint):
    engine = Engine(CausalLM.from_pretrained(checkpoint).eval(), cache_memory=10**8, max_running=2, max_length=64)
    with pytest.raises(ValueError, match=r"build_app: `chat_template`: the chat template is not valid Jinja"):
        build_app(engine, byte_tokenizer(), NAME, chat_template="{% for m in messages %}{{ m.content ")


def test_max_model_len_counts_the_prompt_and_max_tokens(checkpoint):
    """--max-model-len 64 (vLLM's count): a prompt and max_tokens of 64 tokens in all are served; a larger
    max_tokens is an upper bound, the answer ending at the model's length ("length"); a prompt of 64 leaves
    no room (400 naming it); a chat reply's default max_tokens fills what is left, so its usage never counts
    more than 64."""
    with start(CausalLM.from_pretrained(checkpoint).eval(), max_model_len=64) as s:

        def complete(prompt, max_tokens):
            body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
            return post(s, "/v1/completions", json.dumps(body))

        status, out, _ = complete([65] * 60, 4)
        assert status == 200 and out["usage"]["total_tokens"] == 64, out
        status, out, _ = complete([65] * 60, 63)
        assert status == 200 and out["usage"]["total_tokens"] == 64, out
        assert out["choices"][0]["finish_reason"] == "length"
        status, out, _ = complete([65] * 64, 1)
        assert (
            status == 400 and out["error"]["param"] == "prompt" and "a prompt of 63 at most" in out["error"]["message"]
        )
        body = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True, "temperature": 0}
        status, out, _ = post(s, "/v1/chat/completions", json.dumps(body))
        assert status == 200 and out["usage"]["total_tokens"] <= 64, out
        if out["choices"][0]["finish_reason"] == "length":  # not cut short by a stop string
            assert out["usage"]["total_tokens"] == 64, out
    engine = Engine(CausalLM.from_pretrained(checkpoint).eval(), cache_memory=10**8, max_running=2, max_length=64)
    with pytest.raises(ValueError, match=r"`max_prompt_tokens` must be None or an int in \[1, 63\]"):
        build_app(engine, byte_tokenizer(), NAME, max_prompt_tokens=64)


class CountingTokenizer:
    """The byte tokenizer (k3's Tokenizer, so the app knows its longest token), counting the texts it encodes."""

    def __new__(cls):
        tokenizer = byte_tokenizer()
        tokenizer.texts, tokenizer.threads = [], []
        encode_batch = tokenizer.encode_batch

        def counted(texts):
            tokenizer.texts.extend(texts)
            tokenizer.threads.append(threading.current_thread().name)
            return encode_batch(texts)

        tokenizer.encode_batch = counted
        return tokenizer


def test_a_text_too_long_by_its_length_alone_is_refused_before_it_is_tokenized(checkpoint):
    """A text of n bytes has at least n / 13 tokens with the byte tokenizer (<|endoftext|>, 13 bytes, its
    longest token): past --max-prompt-tokens (413) or the model's length (400) by that count, it is refused
    without tokenizing it, which would hold a thread for seconds for a megabyte; a text that may fit is
    tokenized and counted exactly."""
    tokenizer = CountingTokenizer()
    engine = Engine(CausalLM.from_pretrained(checkpoint).eval(), cache_memory=10**8, max_running=2, max_length=512)
    with ServerThread(build_app(engine, tokenizer, NAME, max_prompt_tokens=100), engine) as s:
        status, out, _ = post(s, "/v1/completions", json.dumps({"prompt": "x" * 1301}))
        assert status == 413 and out["error"]["param"] == "prompt", out
        assert "1,301 bytes of text (13 at most a token), so at least 101 tokens" in out["error"]["message"]
        chat = {"messages": [{"role": "user", "content": "x" * 10**6}]}
        status, out, _ = post(s, "/v1/chat/completions", json.dumps(chat))
        assert status == 413 and out["error"]["param"] == "messages", out
        assert "1,000,017 bytes of text (13 at most a token), so at least 76925 tokens" in out["error"]["message"]
        assert tokenizer.texts == []
        status, out, _ = post(s, "/v1/completions", json.dumps({"prompt": "x" * 101}))  # 101 tokens, 8 at least
        assert status == 413 and "the prompt has 101 tokens" in out["error"]["message"], out
        assert tokenizer.texts == ["x" * 101]
    engine = Engine(CausalLM.from_pretrained(checkpoint).eval(), cache_memory=10**8, max_running=2, max_length=64)
    with ServerThread(build_app(engine, tokenizer, NAME), engine) as s:
        status, out, _ = post(s, "/v1/completions", json.dumps({"prompt": "x" * 832}))  # at least 64 tokens
        assert status == 400 and out["error"]["param"] == "prompt", out
        assert "so at least 64 tokens; this model takes 64 tokens at most" in out["error"]["message"]
        assert tokenizer.texts == ["x" * 101]


def test_a_long_text_is_tokenized_on_threads_of_its_own(checkpoint):
    """A text past LONG_TEXT characters goes to the app's own tokenizing threads, a short one to asyncio's:
    honest long prompts never take every thread the short ones need."""
    from k3.serve.api import LONG_TEXT

    tokenizer = CountingTokenizer()
    engine = Engine(CausalLM.from_pretrained(checkpoint).eval(), cache_memory=10**8, max_running=2, max_length=4096)
    with ServerThread(build_app(engine, tokenizer, NAME), engine) as s:
        for text in ("Hi", "x" * (LONG_TEXT + 1)):
            post(s, "/v1/completions", json.dumps({"prompt": text, "max_tokens": 1}))
    short, long = tokenizer.threads
    assert not short.startswith("k3-tokenize") and long.startswith("k3-tokenize"), tokenizer.threads


def test_a_check_of_ours_reads_without_pydantics_prefix(server):
    status, out, _ = post(server, "/v1/completions", json.dumps({"prompt": "hi", "stop": [""]}))
    assert status == 400 and out["error"]["message"].startswith("stop: an empty stop string"), out
