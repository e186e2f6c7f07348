"""Long prompts: a prefill through the cache runs in pieces of `prefill_piece` tokens and equals the full
forward, for the hybrid KDA + MLA presets and GPT-2 (batched prompts of different lengths too); a prompt
past GPT-2's learned positions is a clear error; prefill memory grows linearly with the prompt."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import k3.models.model as model_module
from k3.inference import generation

from .conftest import tiny_model

PIECED = ["kimi-k3-tiny", "kimi-linear-tiny", "gpt2-tiny"]  # hybrid KDA + MLA (K3, Kimi Linear), MHA


def small(name: str):
    """The preset in float64; Kimi Linear in 4 layers (KDA, KDA, KDA, MLA) to keep it quick."""
    return tiny_model(name, **({"num_layers": 4} if name == "kimi-linear-tiny" else {})).double()


@pytest.mark.parametrize("name", PIECED)
def test_prefill_in_several_pieces_then_decode_equals_the_full_forward(name):
    model = small(name)
    ids = torch.randint(0, 512, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(2)
        prefilled = model(ids[:, :19], cache=cache, prefill_piece=4)  # pieces of 4, 4, 4, 4 and 3 tokens
        steps = [model(ids[:, t : t + 1], cache=cache) for t in range(19, 23)]
        assert cache.length == 23
        torch.testing.assert_close(torch.cat([prefilled, *steps], dim=1), full, rtol=1e-9, atol=1e-9)
        last = model(ids[:, :19], cache=model.new_cache(2), prefill_piece=4, logits_to_keep=1)
        assert last.shape == (2, 1, 512)
        torch.testing.assert_close(last[:, 0], full[:, 18], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", PIECED)
def test_batched_prompts_of_different_lengths_prefill_in_pieces(name, monkeypatch):
    """generate's prefill with pieces of 3 tokens: the same last logits, and a cache from which the next
    step gives the same logits, as a prefill in one piece."""
    model = small(name)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (7, 1, 11, 7, 4)]
    step = torch.randint(0, 512, (5, 1), generator=g)
    with torch.no_grad():
        whole, whole_cache = generation.prefill(model, prompts)
        monkeypatch.setattr(model_module, "PREFILL_PIECE", 3)
        pieced, cache = generation.prefill(model, prompts)
        assert cache.lengths == [7, 1, 11, 7, 4]
        torch.testing.assert_close(pieced, whole, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(model(step, cache=cache), model(step, cache=whole_cache), rtol=1e-9, atol=1e-9)


def test_a_prompt_past_the_learned_positions_is_refused_naming_the_lengths():
    model = tiny_model("gpt2-tiny", max_position_embeddings=16)
    with pytest.raises(ValueError, match=r"has 17 tokens; 'gpt2-tiny' has learned positions for 16 tokens"):
        model.generate(torch.zeros(1, 17, dtype=torch.long), max_new_tokens=1)
    with pytest.raises(ValueError, match=r"prompt 1 has 20 tokens"):
        model.generate([[1, 2], [3] * 20], max_new_tokens=1)
    with pytest.raises(ValueError, match=r"10 tokens and `max_new_tokens` is 8, 17 positions .* at most 7 new"):
        next(model.stream(torch.zeros(1, 10, dtype=torch.long), max_new_tokens=8))
    assert model.generate(torch.zeros(1, 10, dtype=torch.long), max_new_tokens=7).shape == (1, 17)
    with pytest.raises(ValueError, match="`prefill_piece` must be a positive int"):
        model(torch.zeros(1, 4, dtype=torch.long), cache=model.new_cache(1), prefill_piece=0)
    with pytest.raises(ValueError, match="`logits_to_keep` must be an int >= 0"):
        model(torch.zeros(1, 4, dtype=torch.long), logits_to_keep=-1)


PEAK_GROWTH = textwrap.dedent("""
    import resource, sys, torch
    import k3.models.model as model_module
    from k3.inference import generation
    from k3.models import CausalLM, get_config

    torch.set_num_threads(1)  # memory, not speed: one thread is quickest on a busy machine
    torch.manual_seed(0)
    model = CausalLM(get_config("kimi-k3-tiny", vocab_size=512)).eval()
    model_module.PREFILL_PIECE = 256
    peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    with torch.no_grad():
        generation.prefill(model, torch.randint(0, 512, (1, 512)))  # warm-up: kernels, thread pools
        base = peak()
        for n in map(int, sys.argv[1:]):
            generation.prefill(model, torch.randint(0, 512, (1, n)))
            print(peak() - base)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB is Linux's")
def test_prefill_memory_grows_linearly_with_the_prompt():
    """Peak RSS growth of a kimi-k3-tiny prefill at N and 4N tokens (one process, pieces of 256): about
    4 times, not the 16 times of [T, T] attention scores (which alone would take 256 MiB at 4N)."""
    n = 1024
    out = subprocess.run(
        [sys.executable, "-c", PEAK_GROWTH, str(n), str(4 * n)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    grown_n, grown_4n = (int(line) / 1024 for line in out.stdout.split())  # MiB
    assert grown_4n <= 6 * grown_n + 16, (grown_n, grown_4n)
    assert grown_4n < 64, (grown_n, grown_4n)
