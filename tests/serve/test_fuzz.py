"""A fuzzer of `k3 serve`'s HTTP API (hypothesis): request bodies drawn over every field of
/v1/completions and /v1/chat/completions, with values of the right type and of every wrong one (huge
ints, NaN, infinities, the tiniest floats, lone surrogates, empty and long strings, lists, objects; prompts
too long by their length alone and prompts that must be tokenized to be counted), and raw bytes; sent
mostly as JSON, now and then with another Content-Type or none (415), and one in sixteen cut short of its
Content-Length (408 once the server's request deadline passes). Whatever comes, the server answers: never
a 5xx, never a hang (each request has a client timeout), every error OpenAI's `{"error": {"message",
"type", "param", "code"}}`, and /health answers afterwards with nothing left running. Meanwhile a client
on a thread asks the same greedy question over and over: it gets the same answer every time, whatever the
fuzzer sends beside it. Bounded to run in seconds: a tiny model, a short context, 200 examples."""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from k3.models import CausalLM, get_config
from k3.serve import Engine, ServerThread, build_app
from k3.tokenizer import byte_tokenizer

NAME = "tiny"
CONTEXT = 64  # max_model_len: every request's work is a few dozen tokens at most
EXAMPLES = int(os.environ.get("K3_FUZZ_EXAMPLES", 200))  # more for a longer hunt
MAX_BYTES = 16 * 1024  # the server's max_request_bytes


@pytest.fixture(scope="module")
def server():
    torch.manual_seed(0)
    model = CausalLM(get_config("kimi-k3-tiny", vocab_size=257, hidden_size=32)).eval()
    engine = Engine(model, cache_memory=10**8, max_queue=64, max_running=32, max_length=CONTEXT)
    limits = dict(max_model_len=CONTEXT, max_request_bytes=MAX_BYTES, max_prompt_tokens=CONTEXT - 1)
    app = build_app(engine, byte_tokenizer(), NAME, **limits)
    with ServerThread(app, engine, request_timeout=1.0) as s:  # a body cut short waits 1 s for its 408
        s.bystander = Bystander(s)
        yield s
        s.bystander.stop()


class Bystander:
    """A client that sends one greedy request again and again until stopped, keeping each (status, text)."""

    BODY = json.dumps({"model": NAME, "prompt": "ROMEO:", "max_tokens": 24, "temperature": 0, "ignore_eos": True})

    def __init__(self, server):
        self.server, self.answers, self._stop = server, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self._stop.is_set():
            status, raw = send(self.server, "/v1/completions", self.BODY.encode())
            self.answers.append((status, json.loads(raw)["choices"][0]["text"] if status == 200 else raw))

    def stop(self, at_least: int = 2) -> list:
        """Its answers, once it has `at_least` of them (a loaded machine may give the fuzzing less time than
        two of its requests take) or a minute has passed."""
        deadline = time.time() + 60
        while len(self.answers) < at_least and time.time() < deadline and self.thread.is_alive():
            time.sleep(0.05)
        self._stop.set()
        self.thread.join(60)
        return self.answers


# -- values ---------------------------------------------------------------------------------------
surrogates = st.characters(categories=["Cs"])
words = st.text(max_size=12)
weird = st.one_of(
    st.text(alphabet=surrogates, min_size=1, max_size=2),
    st.just(""),
    st.builds(lambda a, s, b: a + s + b, st.text(max_size=4), surrogates, st.text(max_size=4)),
)
texts = st.one_of(words, words, words, words, words, weird)
tiny_floats = st.sampled_from([0.0, -0.0, 5e-324, 1e-300, 1e-45, 1.2e-38, 1e-7, 0.5, 1.0, 2.0])
floats = st.one_of(
    tiny_floats, st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1.0000001, 2.0000001, 1e308, -1e-300])
)
huge_ints = st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30, -(2**64), -(10**30), -1])
ints = st.one_of(st.integers(-3, 40), huge_ints)
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts, st.just("x" * 20_000))
junk = st.one_of(scalars, st.lists(scalars, max_size=3), st.dictionaries(st.text(max_size=4), scalars, max_size=2))

# long texts of one, two and four bytes a character, some past the prompt's bound by their length alone
# (refused before they are tokenized), some not (tokenized, then counted)
long_texts = st.builds(lambda piece, n: piece * n, st.sampled_from(["x", "é", "😀", "ab "]), st.integers(40, 3000))

# each field's values of its own type (in range or not: extreme floats, huge seeds, surrogates)
token_ids = st.lists(st.one_of(st.integers(0, 256), st.integers(0, 256), ints), min_size=0, max_size=CONTEXT + 4)
good_prompts = st.one_of(
    words.filter(bool),
    words.filter(bool),
    texts,
    st.lists(texts, max_size=3),
    long_texts,
    token_ids,
    st.lists(token_ids, max_size=3),
)
good_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.one_of(texts, texts, long_texts)},
        optional={"name": texts},
    ),
    min_size=1,
    max_size=3,
)


def mostly(valid, edge):
    """Three draws in four from `valid`, else from `edge` (out of range, or at a limit)."""
    return st.one_of(valid, valid, valid, edge)


GOOD = {
    "model": st.just(NAME),
    "max_tokens": mostly(st.integers(1, 8), huge_ints),
    "temperature": mostly(st.one_of(st.floats(0, 2), tiny_floats), floats),
    "top_p": mostly(st.one_of(st.floats(0, 1, exclude_min=True), tiny_floats.filter(lambda x: 0 < x <= 1)), floats),
    "top_k": mostly(st.integers(1, 300), huge_ints),
    "n": st.integers(1, 3),
    "stop": st.one_of(texts, st.lists(texts, max_size=3)),
    "seed": mostly(st.integers(0, 2**64 - 1), huge_ints),
    "stream": st.booleans(),
    "user": texts,
    "ignore_eos": st.booleans(),
    "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
    ),
}


@st.composite
def bodies(draw, chat: bool) -> bytes:
    """A body with its required field and some optional ones of their own types; now and then one field
    (or a field no endpoint has) replaced by any value at all."""
    fields = dict(
        GOOD,
        **(
            {"messages": good_messages, "max_completion_tokens": st.integers(1, 8)}
            if chat
            else {"prompt": good_prompts}
        ),
    )
    required = "messages" if chat else "prompt"
    chosen = draw(st.lists(st.sampled_from(sorted(fields)), max_size=5, unique=True))
    # (hypothesis draws the first of `sampled_from`'s choices most, and shrinks towards it)
    keep_required = draw(st.sampled_from([True] * 9 + [False]))
    body = {name: draw(fields[name]) for name in [required, *chosen] if name != required or keep_required}
    if draw(st.sampled_from([False] * 4 + [True])):
        body[draw(st.sampled_from(sorted(fields) + ["logprobs", "tools", "\ud800"]))] = draw(junk)
    return encode(body)


def encode(body) -> bytes:
    """JSON as Python writes it: NaN and Infinity spelled out, a lone surrogate as its \\u escape."""
    return json.dumps(body, allow_nan=True).encode()


# bodies the server must answer 200: every setting in range, the extreme ones included
in_range = {
    "max_tokens": st.integers(1, 8),
    "temperature": st.one_of(st.floats(0, 2), tiny_floats),
    "top_p": st.one_of(st.floats(0, 1, exclude_min=True), st.sampled_from([5e-324, 1e-300, 1e-45, 1.0])),
    "top_k": st.integers(1, 300),
    "n": st.integers(1, 3),
    "seed": st.integers(0, 2**64 - 1),
    "stream": st.booleans(),
    "ignore_eos": st.booleans(),
    "stop": st.lists(words.filter(bool), max_size=2),  # an empty stop string is refused (400)
}
valid = st.one_of(
    st.tuples(
        st.just("/v1/completions"),
        st.fixed_dictionaries(
            {"prompt": st.one_of(words.filter(bool), st.lists(st.integers(0, 256), min_size=1, max_size=12))},
            optional=in_range,
        ).map(encode),
    ),
    st.tuples(
        st.just("/v1/chat/completions"),
        st.fixed_dictionaries({"messages": good_messages}, optional=in_range).map(encode),
    ),
)

# bodies past a parser's limits: nesting, digits, more prompts than the queue holds
HOSTILE = [
    b"{" * 5000,
    b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"prompt": "a", "n": 1' + b"0" * 5000 + b"}",
    b'{"prompt": ' + json.dumps([[1]] * 300).encode() + b"}",
]

paths_and_bodies = st.one_of(
    valid,
    st.tuples(st.just("/v1/completions"), bodies(chat=False)),
    st.tuples(st.just("/v1/chat/completions"), bodies(chat=True)),
    st.tuples(
        st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
        st.one_of(st.binary(max_size=40), junk.map(encode), st.sampled_from(HOSTILE)),
    ),
)
JSON_TYPES = ["application/json", "application/json; charset=utf-8", "application/vnd.k3+json"]
OTHER_TYPES = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=k3", "", None]


@st.composite
def requests(draw) -> tuple[str, bytes, str | None, int | None]:
    """(path, body, Content-Type, cut): mostly JSON's type, now and then another or none; one request in
    sixteen stops after `cut` bytes of its body, its Content-Length promising all of them."""
    path, body = draw(paths_and_bodies)
    content_type = draw(st.one_of(*[st.just("application/json")] * 6, st.sampled_from(JSON_TYPES + OTHER_TYPES)))
    cut = None
    if body and draw(st.sampled_from([False] * 15 + [True])):
        cut = draw(st.integers(0, len(body) - 1))
    return path, body, content_type, cut


def send(server, path: str, body: bytes, content_type: str | None = "application/json") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)  # a hang fails with a timeout
    try:
        conn.request("POST", path, body, {} if content_type is None else {"Content-Type": content_type})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def send_part(server, path: str, body: bytes, content_type: str | None, cut: int) -> tuple[int, bytes]:
    """The request with its body cut after `cut` bytes: (status, body) of the answer, read until closed."""
    head = f"POST {path} HTTP/1.1\r\nHost: k3\r\nContent-Length: {len(body)}\r\n"
    head += "" if content_type is None else f"Content-Type: {content_type}\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head.encode() + b"\r\n" + body[:cut])
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    top, _, rest = data.partition(b"\r\n\r\n")
    return int(top.split()[1]), rest


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(request=requests())
def test_any_request_is_answered_without_a_server_error(server, request):
    path, body, content_type, cut = request
    if cut is None:
        status, raw = send(server, path, body, content_type)
    else:
        status, raw = send_part(server, path, body, content_type, cut)
    event(f"HTTP {status}")
    assert status < 500, (status, raw[:500], body[:300], content_type)
    if cut is not None:  # 413 at once when its Content-Length is over the bound, else 408 at the deadline
        assert status == (413 if len(body) > MAX_BYTES else 408), (status, raw[:300])
    elif content_type not in JSON_TYPES:  # 415; or the gate's 400 (not UTF-8), 413 (too big) before it
        assert status in (400, 413, 415), (status, raw[:300], content_type)
    if status >= 400:
        error = json.loads(raw)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == status, raw
        assert isinstance(error["message"], str) and error["message"]
    elif b'"stream": true' not in body and b'"stream":true' not in body:
        answer = json.loads(raw)
        assert answer["choices"] and all(not c["finish_reason"].startswith("error") for c in answer["choices"])
    else:
        assert raw.rstrip().endswith(b"data: [DONE]") and b'"server_error"' not in raw, raw[-300:]


def test_the_server_is_well_after_the_fuzzing(server):
    answers = server.bystander.stop()
    assert len(answers) >= 2 and all(a == answers[0] for a in answers) and answers[0][0] == 200, set(answers)
    deadline = time.time() + 30
    while True:
        stats = server.engine.stats()
        if stats["running"] == 0 and stats["waiting"] == 0 and stats["cache_bytes_reserved"] == 0:
            break
        assert time.time() < deadline, stats
        time.sleep(0.05)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("GET", "/health")
    r = conn.getresponse()
    assert r.status == 200 and json.loads(r.read())["status"] == "ok"
