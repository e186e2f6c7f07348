"""`k3 generate` without --prompt: prompts from stdin, one a line, each continuation streamed; the cache
reset between prompts, or kept across turns with --chat (a turn feeds only its own tokens); Ctrl-D ends
(exit 0), Ctrl-C stops one generation (or exits 130 at the prompt). Piped stdin stands in for a terminal;
a tiny untrained kimi-k3-tiny with the byte tokenizer."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3.cli import main
from k3.models import CausalLM, get_config
from k3.tokenizer import byte_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TOKENS = ["--max-new-tokens", "5", "--temperature", "0"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("interactive")
    torch.manual_seed(0)
    CausalLM(get_config("kimi-k3-tiny", vocab_size=257, hidden_size=32)).save_pretrained(path)
    byte_tokenizer().save(path / "tokenizer.json")
    return path


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run(monkeypatch, capsys, argv: list[str], stdin: str | io.StringIO) -> tuple[int, str, str]:
    """main(argv) with `stdin` as its standard input: (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin) if isinstance(stdin, str) else stdin)
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def streams(monkeypatch):
    """Each CausalLM.stream call as (prompt ids, the cache given, its length then, the tokens yielded)."""
    calls = []
    original = CausalLM.stream

    def stream(self, prompt, *args, cache=None, **kwargs):
        call = (prompt[0].tolist(), cache, None if cache is None else cache.length, [])
        calls.append(call)
        for token in original(self, prompt, *args, cache=cache, **kwargs):
            call[3].append(int(token[0]))
            yield token

    monkeypatch.setattr(CausalLM, "stream", stream)
    return calls


def test_each_prompt_on_its_own_as_with_prompt(checkpoint, monkeypatch, capsys, one_thread):
    generate = ["generate", "--checkpoint", str(checkpoint), *TOKENS]
    code, out, err = run(monkeypatch, capsys, generate, "to be\n\n  \nor not\n")
    assert code == 0 and err.count("[5 tokens in") == 2, err
    # the same computation as `k3 generate --prompt` of each line alone: the cache starts afresh
    singles = [run(monkeypatch, capsys, [*generate, "--prompt", text], "")[1] for text in ("to be", "or not")]
    assert out == "".join(singles) and singles[0].startswith("to be")


def test_chat_keeps_the_cache_and_feeds_only_the_new_turn(checkpoint, monkeypatch, capsys, streams, one_thread):
    encode = byte_tokenizer().encode
    code, out, err = run(
        monkeypatch, capsys, ["generate", "--checkpoint", str(checkpoint), "--chat", *TOKENS], "to be\nor not\n"
    )
    assert code == 0 and out.startswith("to be") and "\nor not" in out, out
    (ids1, cache1, seen1, new1), (ids2, cache2, seen2, new2) = streams
    assert ids1 == encode("to be") and seen1 == 0
    # the same cache, which has seen all but the last token sampled: that token, then "\n" + the prompt
    assert cache2 is cache1 and seen2 == len(ids1) + len(new1) - 1
    assert ids2 == new1[-1:] + encode("\nor not")
    assert cache1.length == seen2 + len(ids2) + len(new2) - 1


def test_without_chat_every_prompt_gets_a_new_cache(checkpoint, monkeypatch, capsys, streams, one_thread):
    code, _, _ = run(monkeypatch, capsys, ["generate", "--checkpoint", str(checkpoint), *TOKENS], "to be\nor not\n")
    assert code == 0 and [(ids, cache) for ids, cache, _, _ in streams] == [
        (byte_tokenizer().encode("to be"), None),
        (byte_tokenizer().encode("or not"), None),
    ]


def test_chat_continues_as_the_whole_conversation_would():
    """The kept cache gives the tokens a fresh prefill of the whole conversation gives (float64, where two
    code paths' rounding cannot flip an argmax)."""
    torch.manual_seed(0)
    model = CausalLM(get_config("kimi-k3-tiny", vocab_size=64, hidden_size=32)).double().eval()
    turn1, turn2 = torch.randint(0, 64, (1, 7)), torch.randint(0, 64, (1, 5))
    cache = model.new_cache(1)
    new1 = torch.stack(list(model.stream(turn1, 6, temperature=0, cache=cache)), dim=1)
    new2 = torch.stack(list(model.stream(torch.cat([new1[:, -1:], turn2], 1), 6, temperature=0, cache=cache)), dim=1)
    whole = torch.cat([turn1, new1, turn2], dim=1)
    assert torch.equal(model.generate(whole, 6, temperature=0)[:, whole.shape[1] :], new2)
    assert cache.length == whole.shape[1] + 5
    with pytest.raises(ValueError, match="the cache holds 1 sequences, `input_ids` has 2"):
        next(model.stream(torch.zeros(2, 3, dtype=torch.long), 1, cache=cache))
    gpt2 = CausalLM(get_config("gpt2-tiny", vocab_size=64, max_position_embeddings=16)).eval()
    cache = gpt2.new_cache(1)
    list(gpt2.stream(torch.zeros(1, 10, dtype=torch.long), 2, cache=cache))
    with pytest.raises(ValueError, match=r"the context \(11 tokens in the cache, 6 new\) has 17 tokens"):
        next(gpt2.stream(torch.zeros(1, 6, dtype=torch.long), 1, cache=cache))


def test_ctrl_c_stops_one_generation_and_chat_rebuilds_its_cache(checkpoint, monkeypatch, capsys, streams, one_thread):
    recording = CausalLM.stream

    def interrupted_first(self, prompt, *args, **kwargs):
        for i, token in enumerate(recording(self, prompt, *args, **kwargs)):
            if len(streams) == 1 and i == 2:
                raise KeyboardInterrupt
            yield token

    monkeypatch.setattr(CausalLM, "stream", interrupted_first)
    code, out, err = run(
        monkeypatch, capsys, ["generate", "--checkpoint", str(checkpoint), "--chat", *TOKENS], "to be\nor not\n"
    )
    assert code == 0 and "[interrupted (Ctrl-C) after 2 tokens]" in err and err.count("[5 tokens in") == 1, err
    assert out.startswith("to be") and "\nor not" in out
    (ids1, _, _, new1), (ids2, cache2, seen2, _) = streams
    # the conversation keeps the 2 tokens printed; the new cache is prefilled with all of it
    assert seen2 == 0 and ids2 == ids1 + new1[:2] + byte_tokenizer().encode("\nor not")


def test_ctrl_d_ends_with_0_and_ctrl_c_at_the_prompt_with_130(checkpoint, monkeypatch, capsys):
    generate = ["generate", "--checkpoint", str(checkpoint)]
    assert run(monkeypatch, capsys, generate, "") == (0, "", "")

    class CtrlC(io.StringIO):
        def readline(self, *args):
            raise KeyboardInterrupt

    code, out, err = run(monkeypatch, capsys, generate, CtrlC())
    assert code == 130 and "k3 generate: interrupted (Ctrl-C)" in err


def test_chat_needs_the_interactive_mode_and_says_so_in_help(checkpoint, monkeypatch, capsys):
    code, _, err = run(
        monkeypatch, capsys, ["generate", "--checkpoint", str(checkpoint), "--chat", "--prompt", "x"], ""
    )
    assert code == 2 and err.strip() == (
        "k3 generate: error: --chat is for the interactive mode (prompts from "
        "stdin): drop --prompt / --prompt-file, or --chat"
    )
    code, out, _ = run(monkeypatch, capsys, ["generate", "--help"], "")
    flat = " ".join(out.split())
    assert code == 0 and "read prompts from stdin, one a line" in flat and "Ctrl-D ends" in flat
    assert "--chat prompts from stdin: each one continues the conversation" in flat


def test_piped_into_the_command(checkpoint, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "k3", "generate", "--checkpoint", str(checkpoint), "--chat", "--max-new-tokens", "3"],
        input="to be\nor not\n",
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("to be") and "\nor not" in done.stdout and done.stderr.count("[3 tokens in") == 2


@pytest.mark.parametrize("mode", ["prompt", "prompt-file"])
def test_a_continuation_ends_at_endoftext_unless_ignored(checkpoint, monkeypatch, capsys, tmp_path, mode):
    """The sampler says <|endoftext|> at the third step: the continuation ends there and the token is not
    printed; --ignore-eot goes on to --max-new-tokens."""
    from k3.inference import generation
    from k3.tokenizer import Tokenizer

    eot = Tokenizer.load(checkpoint).eot_id
    real, calls = generation.sample, []

    def eot_third(logits, *args, **kwargs):
        calls.append(None)
        token = real(logits, *args, **kwargs)
        return torch.full_like(token, eot) if len(calls) % 10 == 3 else token.masked_fill(token == eot, 65)

    monkeypatch.setattr(generation, "sample", eot_third)
    source = ["--prompt", "ab"] if mode == "prompt" else ["--prompt-file", str(tmp_path / "p.txt")]
    (tmp_path / "p.txt").write_text("ab\n")
    outs = []
    for extra in ([], ["--ignore-eot"]):
        calls.clear()
        code, out, err = run(
            monkeypatch,
            capsys,
            [
                "generate",
                "--checkpoint",
                str(checkpoint),
                *source,
                "--max-new-tokens",
                "6",
                "--temperature",
                "0",
                *extra,
            ],
            "",
        )
        assert code == 0, err
        outs.append((out, err))
    (stopped, stopped_err), (full, _) = outs
    assert "<|endoftext|>" not in stopped
    if mode == "prompt":
        assert stopped_err.startswith("[3 tokens") and len(full.rstrip("\n")) > len(stopped.rstrip("\n"))
    else:
        assert "3 new tokens" in stopped_err
