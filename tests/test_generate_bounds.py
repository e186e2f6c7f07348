"""Sizes that cannot fit are refused before they are allocated (issue 46, point 4): a static cache
(`new_cache(B, max_length=N)`), `generate`/`stream` eager and compiled, and `k3 generate --max-new-tokens`;
a prompt long enough to take seconds of prefill shows its progress in `k3 generate` and continues exactly
as one prefill would."""

from __future__ import annotations

import types

import pytest
import torch

from k3.cli import interactive, main
from k3.models import CausalLM, get_config
from k3.tokenizer import byte_tokenizer


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return CausalLM(get_config("kimi-k3-tiny", vocab_size=257, hidden_size=32)).eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, model):
    path = tmp_path_factory.mktemp("bounds")
    model.save_pretrained(path)
    byte_tokenizer().save(path / "tokenizer.json")
    return path


def test_a_static_cache_too_big_for_the_machine_is_refused_before_allocating(model):
    with pytest.raises(
        ValueError,
        match=r"new_cache: a static cache of 1000000 row\(s\) x 1,000,000 tokens .* "
        r"more than the .* GiB of memory available",
    ):
        model.new_cache(10**6, max_length=10**6)
    assert model.new_cache(2, max_length=64).max_length == 64


@pytest.mark.parametrize("compile", [False, "aot_eager"])
def test_generate_refuses_a_cache_that_cannot_fit(model, compile):
    with pytest.raises(ValueError, match="generate: 1 sequence.*100,000,000 new ones.*--max-new-tokens"):
        model.generate(torch.tensor([[1, 2, 3]]), 100_000_000, compile=compile)


def test_cache_bytes_is_what_a_static_cache_allocates(model):
    cache = model.new_cache(3, max_length=40)
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in layer.buffers())
    assert model.cache_bytes(3, 40) <= held <= model.cache_bytes(3, 40) * 1.1 + 4096


def test_k3_generate_max_new_tokens_too_big_is_one_line(checkpoint, capsys):
    for extra in ([], ["--compile"]):
        assert (
            main(
                ["generate", "--checkpoint", str(checkpoint), "--prompt", "hi", "--max-new-tokens", "100000000", *extra]
            )
            == 2
        )
        out, err = capsys.readouterr()
        assert out == ""  # refused before the prompt is echoed
        err = err.strip().splitlines()
        assert err[-1].startswith("k3 generate: error: generate: 1 sequence") and "--max-new-tokens" in err[-1]


def test_a_long_prompt_prefills_with_progress_and_continues_exactly(model, capsys, monkeypatch):
    monkeypatch.setattr(interactive, "LONG_PROMPT", 40)
    monkeypatch.setattr("k3.models.model.PREFILL_PIECE", 16)
    ids = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    want = model.generate(torch.tensor([ids]), 6, temperature=0)[0, 100:].tolist()
    tokenizer = byte_tokenizer()
    for compile in (False, "aot_eager"):
        args = types.SimpleNamespace(
            ignore_eot=True, compile=compile, max_new_tokens=6, temperature=0.0, top_k=None, top_p=None
        )
        new: list[int] = []
        interactive.stream_text(model, tokenizer, ids, args, None, new)
        assert new == want, compile
        assert "prefill" in capsys.readouterr().err  # the bar, on stderr


def test_a_long_prompt_file_prefills_with_progress_and_the_same_tokens(checkpoint, tmp_path, capsys, monkeypatch):
    """`--prompt-file` (prompts generated together) shows the prefill's progress past LONG_PROMPT tokens in
    all, and writes what it writes without the bar."""
    monkeypatch.setattr("k3.models.model.PREFILL_PIECE", 16)
    lines = tmp_path / "prompts.txt"
    lines.write_text("to be or not to be, " * 3 + "\nthat is the question\n")
    argv = ["generate", "--checkpoint", str(checkpoint), "--prompt-file", str(lines), "--temperature", "0"]
    argv += ["--max-new-tokens", "5", "--ignore-eot"]
    assert main(argv) == 0
    quiet_out, quiet_err = capsys.readouterr()
    assert "prefill:" not in quiet_err
    monkeypatch.setattr(interactive, "LONG_PROMPT", 40)
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out == quiet_out and "prefill:" in err and "/80 " in err  # the 60 + 20 prompt tokens
