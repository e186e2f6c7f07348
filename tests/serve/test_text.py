"""Streaming detokenization and stop strings, and chat prompts (plain and the checkpoint's template)."""

from __future__ import annotations

import json
import time

import pytest

from k3.serve.text import PLAIN_STOPS, TextStream, chat_prompt, load_chat_template
from k3.tokenizer import byte_tokenizer


def pieces(text: str, stop=None) -> tuple[list[str], TextStream]:
    tok = byte_tokenizer()
    stream = TextStream(tok, stop)
    out = []
    for token in tok.encode(text):
        out.append(stream.push(token))
        if stream.stopped:
            break
    out.append(stream.finish())
    return [p for p in out if p], stream


def test_characters_are_never_split():
    out, _ = pieces("aé漢😀b")  # 1, 2, 3 and 4 bytes
    assert out == ["a", "é", "漢", "😀", "b"]


def test_stop_string_ends_the_text_before_it():
    out, stream = pieces("Hello world. User: more", stop=["User:"])
    assert "".join(out) == "Hello world. " and stream.stopped
    assert not any("U" in p for p in out)  # the stop string's start was held back, never sent


def test_text_that_only_looks_like_a_stop_start_is_released():
    out, stream = pieces("a Us b", stop=["User:"])
    assert "".join(out) == "a Us b" and not stream.stopped


def test_no_stop_strings():
    out, _ = pieces("plain text")
    assert "".join(out) == "plain text"


def test_plain_chat_prompt():
    text = chat_prompt([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}])
    assert text == "System: Be terse.\nUser: Hi\nAssistant:"
    assert "\nUser:" in PLAIN_STOPS


def test_checkpoint_chat_template(tmp_path):
    template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    loaded = load_chat_template(tmp_path)
    assert loaded == template
    assert (
        chat_prompt([{"role": "user", "content": "Hi"}], loaded, {"bos_token": "<s>"}) == "<s><|user|>Hi<|assistant|>"
    )
    assert load_chat_template(tmp_path / "nothing") is None


def test_template_refusal_is_a_value_error():
    with pytest.raises(ValueError, match="refused"):
        chat_prompt([{"role": "user", "content": "x"}], "{{ raise_exception('no system role') }}")


def test_long_stop_strings_cost_what_is_pending_not_the_whole_text():
    """16 stop strings of 100,000 characters that never match: a token late in a long answer costs about
    what an early one does (the held-back search looks only at text not yet handed out)."""
    tok = byte_tokenizer()
    a = tok.encode("a")[0]
    stream = TextStream(tok, ["b" * 100_000] * 16)
    early = time.perf_counter()
    for _ in range(200):
        stream.push(a)
    early = time.perf_counter() - early
    for _ in range(4000):
        stream.push(a)
    late = time.perf_counter()
    for _ in range(200):
        assert stream.push(a) == "a"
    late = time.perf_counter() - late
    assert late < 5 * early + 0.05, (early, late)
