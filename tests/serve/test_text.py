"""Streaming detokenization and stop strings, and chat prompts (plain and the checkpoint's template)."""

from __future__ import annotations

import json
import random
import time

import pytest

from k3.serve.text import (
    PLAIN_STOPS,
    TemplateRefusal,
    TextStream,
    chat_prompt,
    load_chat_template,
    longest_token_bytes,
    special_tokens,
)
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
    with pytest.raises(TemplateRefusal, match="refused"):
        chat_prompt([{"role": "user", "content": "x"}], "{{ raise_exception('no system role') }}")


DAMAGED = [  # (file, content, words of the one-line error after the file's path)
    ("tokenizer_config.json", b"[1,2]", "a JSON array, expected an object"),
    ("tokenizer_config.json", b'{"chat_template": [5, {"name": "default", "template": "x"}]}', "chat_template[0]"),
    ("tokenizer_config.json", b'{"chat_template": [{"name": "tool_use", "template": "x"}]}', "none named 'default'"),
    ("tokenizer_config.json", b'{"chat_template": 5}', "chat_template is a JSON number"),
    ("tokenizer_config.json", b'{"chat_template": \n', "not valid JSON (Expecting value at line 2 column 1)"),
    ("tokenizer_config.json", b'{"chat_template": "\xff"}', "not UTF-8 text (byte 0xff at position 19)"),
    ("tokenizer_config.json", b'{"chat_template": "{% for m in messages %}"}', "not valid Jinja"),
    ("chat_template.jinja", b"\xff\xfe{{ x }}", "not UTF-8 text (byte 0xff at position 0)"),
    ("chat_template.jinja", b"{% for m in messages %}{{ m.content ", "not valid Jinja: unexpected end of template"),
    ("chat_template.jinja", None, "a folder, expected a file"),
]


@pytest.mark.parametrize("name,content,words", DAMAGED)
def test_a_damaged_chat_template_or_tokenizer_config_is_named_in_one_line(tmp_path, name, content, words):
    """What the checkpoint holds is read and compiled at start-up: anything wrong with it is one line naming
    the file, not a traceback, a decoder's message without the file, or a failure at each request."""
    if content is None:
        (tmp_path / name).mkdir()
    else:
        (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError) as e:
        load_chat_template(tmp_path)
    message = str(e.value)
    assert message.startswith(str(tmp_path / name)) and words in message and "\n" not in message, message


def test_special_tokens_for_the_template(tmp_path):
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}}))
    assert special_tokens(tmp_path) == {"bos_token": "<s>", "eos_token": "</s>"}
    config.write_text(json.dumps({"bos_token": 5}))
    with pytest.raises(ValueError, match="bos_token is a JSON number"):
        special_tokens(tmp_path)
    assert special_tokens(tmp_path / "nothing") == {}


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


def test_a_texts_bytes_over_the_longest_token_bound_its_tokens():
    """The app refuses a text too long by this count before tokenizing it: it must never count more tokens
    than tokenizing gives, for the byte tokenizer (<|endoftext|>, 13 bytes, is its longest token) or a BPE
    one (whose merges span many bytes), over ASCII, multi-byte text and special tokens."""
    from k3.tokenizer import EOT, train_bpe

    random.seed(0)
    alphabet = "ab cd\né€😀" + EOT
    corpus = ["".join(random.choice(["abab ", "cdcd ", "é€", EOT, "😀 "]) for _ in range(400)) for _ in range(20)]
    for tokenizer in (byte_tokenizer(), train_bpe(corpus, vocab_size=400)):
        longest = longest_token_bytes(tokenizer)
        assert longest == max(13, max(tokenizer.token_bytes)), longest
        for _ in range(300):
            text = "".join(random.choice([*alphabet, EOT, "abab ", "cdcd "]) for _ in range(random.randrange(1, 200)))
            assert len(tokenizer.encode(text)) >= -(-len(text.encode()) // longest), text
    assert longest_token_bytes(object()) is None  # not k3's tokenizer: no bound from the length
