"""OpenAI's fields as clients send them, through the official `openai` client: logprobs and top_logprobs
(chat), logprobs and echo (completions), presence and frequency penalties, each checked against the model
itself; a lagging stream's text in fewer events; a stream that fails ends with an error event and [DONE]."""

from __future__ import annotations

import asyncio
import http.client
import json

import openai
import pytest
import torch

from k3.models import CausalLM
from k3.serve.answers import BYTE_OF
from k3.serve.jobs import Job
from k3.serve.text import TextStream, chat_prompt
from k3.tokenizer import byte_tokenizer

from .conftest import NAME, poison_sampling, post

TOKENIZER = byte_tokenizer()
ID_OF_BYTE = {b: TOKENIZER.inner.token_to_id(ch) for ch, b in BYTE_OF.items()}  # the byte tokenizer's ids


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(checkpoint):
    return CausalLM.from_pretrained(checkpoint).eval()


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: log p(next | ids[:i+1]) from one forward of the whole text."""
    with torch.no_grad():
        return model(torch.tensor([ids])).float().log_softmax(-1)[0]


def test_chat_logprobs_are_the_models(client, model):
    """Each generated token's logprob and its top_logprobs alternatives equal the model's distribution at
    that position (greedy: the chosen token is the likeliest); `bytes` spell the content; the stream's
    entries are the whole answer's."""
    messages = [{"role": "user", "content": "Hi there"}]
    prompt = TOKENIZER.encode(chat_prompt(messages))
    kw = dict(model=NAME, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    r = client.chat.completions.create(**kw)
    entries = r.choices[0].logprobs.content
    generated = [ID_OF_BYTE[e.bytes[0]] for e in entries]  # the byte tokenizer: a token a byte
    assert len(entries) == r.usage.completion_tokens
    spelled = bytes(b for e in entries for b in e.bytes).decode("utf-8", "replace")
    assert spelled.startswith(r.choices[0].message.content)
    reference = reference_logprobs(model, prompt + generated)[len(prompt) - 1 :]
    for i, e in enumerate(entries):
        values, ids = reference[i].topk(3)
        assert e.logprob == pytest.approx(reference[i, generated[i]].item(), abs=1e-4)
        assert [ID_OF_BYTE[t.bytes[0]] for t in e.top_logprobs] == ids.tolist()
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
        assert e.top_logprobs[0].token == e.token  # greedy
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in entries]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries], abs=1e-6)
    plain = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == r.choices[0].message.content


def test_completion_logprobs_and_echo(client, model):
    """logprobs=2 with echo: the text is the prompt and its completion; the prompt's tokens come first, the
    first with no logprob, the others the model's; text_offset counts characters; the stream agrees."""
    kw = dict(model=NAME, prompt="Hello", max_tokens=5, temperature=0, logprobs=2, echo=True)
    r = client.completions.create(**kw)
    choice, prompt = r.choices[0], TOKENIZER.encode("Hello")
    lp = choice.logprobs
    ids = list(prompt)
    for _ in range(5):  # the greedy continuation, by the model itself
        ids.append(int(reference_logprobs(model, ids)[-1].argmax()))
    assert choice.text == TOKENIZER.decode(ids) and lp.tokens == [TOKENIZER.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[:3] == [0, 1, 2]
    reference = reference_logprobs(model, ids)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(reference[i - 1, ids[i]].item(), abs=1e-4)
        top = reference[i - 1].topk(2)  # keyed by text: two partial characters may both read "\ufffd"
        assert {TOKENIZER.decode([t]) for t in top.indices.tolist()} == set(lp.top_logprobs[i])
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
    bare = client.completions.create(model=NAME, prompt="Hello", max_tokens=5, temperature=0, echo=True)
    assert bare.choices[0].text == choice.text and bare.choices[0].logprobs is None
    alone = client.completions.create(model=NAME, prompt="Hello", max_tokens=5, temperature=0, logprobs=0)
    assert alone.choices[0].logprobs.tokens == lp.tokens[len(prompt) :]
    assert alone.choices[0].logprobs.top_logprobs == [{}] * 5


def greedy_with_penalties(model, prompt: list[int], n: int, presence: float, frequency: float) -> list[int]:
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([prompt + out]))[0, -1].float()
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float()
            out.append(int((logits - presence * (counts > 0) - frequency * counts).argmax()))
    return out


def test_penalties_are_openais(client, model):
    prompt = TOKENIZER.encode("Hello")
    for presence, frequency in [(0.0, 2.0), (1.5, 0.0), (-1.0, 0.5)]:
        r = client.completions.create(
            model=NAME,
            prompt="Hello",
            max_tokens=12,
            temperature=0,
            presence_penalty=presence,
            frequency_penalty=frequency,
            extra_body={"ignore_eos": True},
        )
        assert r.choices[0].text == TOKENIZER.decode(greedy_with_penalties(model, prompt, 12, presence, frequency))


@pytest.mark.parametrize(
    "path, field, body",
    [
        ("/v1/chat/completions", "top_logprobs", {"top_logprobs": 2}),
        ("/v1/chat/completions", "top_logprobs", {"logprobs": True, "top_logprobs": 21}),
        ("/v1/completions", "logprobs", {"logprobs": 21}),
        ("/v1/completions", "logprobs", {"logprobs": True}),
        ("/v1/completions", "presence_penalty", {"presence_penalty": 2.5}),
        ("/v1/chat/completions", "frequency_penalty", {"frequency_penalty": "1"}),
        ("/v1/completions", "echo", {"echo": 1}),
    ],
)
def test_out_of_range_settings_are_400_naming_them(server, path, field, body):
    base = {"model": NAME, "max_tokens": 2}
    base.update({"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": "Hi"})
    code, out, _ = post(server, path, json.dumps({**base, **body}))
    assert code == 400 and out["error"]["param"] == field, out


def test_a_lagging_reader_gets_what_piled_up_in_one_batch():
    """Tokens queued while nobody read come out as one batch (one event a choice): a slow client costs
    fewer events, not one per token."""

    async def run():
        job = Job(asyncio.get_running_loop())

        class Sequence:
            finish_reason = None

        job.sequences.append(Sequence())
        job.streams.append(TextStream(TOKENIZER))
        job.reasons.append(None)
        job.counts.append(0)
        for token in TOKENIZER.encode("lagging"):
            job.queue.put_nowait((0, "token", token))
        job.queue.put_nowait((0, "finish", "length"))
        return [batch async for batch in job.batches(engine=None)]

    batches = asyncio.run(run())
    assert len(batches) == 1 and "".join(text for _, text, _ in batches[0]) == "lagging"
    assert batches[0][-1][2] == "length"


def test_a_stream_that_fails_ends_with_an_error_event_and_done(server, monkeypatch):
    poison_sampling(monkeypatch, lambda s: s.temperature == 0.625, "poisoned row")
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = {"model": NAME, "prompt": "Hi", "max_tokens": 4, "temperature": 0.625, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    lines = [line for line in conn.getresponse().read().decode().split("\n") if line]
    conn.close()
    assert lines[-1] == "data: [DONE]" and "poisoned row" in lines[-2] and '"server_error"' in lines[-2]


def test_usage_counts_the_prompt_tokens_the_prefix_cache_gave(client):
    """usage.prompt_tokens_details.cached_tokens (OpenAI's; what aiperf reads): 0 the first time, the cached
    blocks' tokens when the same prompt comes again."""
    prompt = "All the world's a stage, and all the men and women merely players. " * 5  # 335 bytes: a block
    first = client.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 256 and again.choices[0].text == first.choices[0].text
