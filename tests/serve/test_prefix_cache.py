"""Prefix caching is exact: a prompt resumed from cached blocks (attention entries, recurrent states and
convolution windows at block ends) gets the logits, the state and the tokens of computing it cold, for
every kind of model with a cache, at prompt lengths below, at and across block boundaries; eviction
frees what it counts; the engine gives the same tokens with the cache on and off."""

from __future__ import annotations

import time

import pytest
import torch

from k3.models import PRESETS as ALL_PRESETS
from k3.models import CausalLM, get_config
from k3.serve import Engine, Sequence
from k3.serve.prefix import PrefixCache

PRESETS = [name for name in ALL_PRESETS if name.endswith("-tiny")]  # every kind of cache
BLOCK = 8


def tiny(preset: str, dtype=torch.float32) -> CausalLM:
    torch.manual_seed(0)
    overrides = {"max_position_embeddings": 128} if preset == "gpt2-tiny" else {}
    return CausalLM(get_config(preset, vocab_size=97, hidden_size=32, **overrides)).to(dtype).eval()


def prefill(model, prompt: list[int], prefix: PrefixCache):
    """What the engine does: resume from the longest cached run, then pieces that end at block
    boundaries, keeping each block; (the last position's logits, the cache, tokens restored)."""
    cache = model.new_cache(1, max_length=len(prompt))
    run = prefix.lookup(prompt)
    if run:
        prefix.restore(run, cache)
    done = len(run) * prefix.block
    while done < len(prompt):
        n = min(prefix.block - done % prefix.block, len(prompt) - done)
        logits = model(torch.tensor([prompt[done : done + n]]), cache=cache, logits_to_keep=1)[:, -1]
        done += n
        if done % prefix.block == 0:
            prefix.insert(prompt, done, cache)
    return logits, cache, len(run) * prefix.block


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("preset", PRESETS)
def test_a_hit_gives_what_the_cold_path_gives(preset):
    model = tiny(preset)
    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, 97, (40,), generator=g).tolist()
    other = torch.randint(0, 97, (40,), generator=g).tolist()
    prefix = PrefixCache(BLOCK)
    with torch.inference_mode():
        prefill(model, base[:32], prefix)  # warms blocks ending at 8, 16, 24, 32
        assert len(prefix) == 4
        # (prompt, tokens a hit restores): below a block, at one (the block ending at the prompt's end is
        # not used: its last token's logits must be computed), across one and two, a diverging prompt
        cases = [
            (base[:5], 0),
            (base[:8], 0),
            (base[:9], 8),
            (base[:16], 8),
            (base[:17], 16),
            (base[:29], 24),
            (base[:12] + other[:9], 8),
            (other[:20], 0),
        ]
        for prompt, restored in cases:
            logits, cache, hit = prefill(model, prompt, prefix)
            assert hit == restored, (len(prompt), hit)
            cold_logits = model(torch.tensor([prompt]))[:, -1]
            close(logits, cold_logits)
            cold = model.new_cache(1, max_length=len(prompt))
            model(torch.tensor([prompt]), cache=cold)
            assert cache.lengths == cold.lengths and int(cache.positions[0]) == len(prompt)
            for mine, theirs in zip(cache.layers, cold.layers):
                for a, b in zip(mine.buffers(), theirs.buffers()):
                    close(a, b)
            # and decoding on from there gives the cold path's tokens
            token = logits.argmax(-1, keepdim=True)
            assert torch.equal(token, cold_logits.argmax(-1, keepdim=True))
            grown, reference = model.new_cache(1), model.new_cache(1)
            _continue(grown, cache, prompt)
            model(torch.tensor([prompt]), cache=reference)
            close(model(token, cache=grown), model(token, cache=reference))


def _continue(grown, restored, prompt):
    """Copy a restored static cache's row into a growing one (the engine moves it into a slot the same way)."""
    grown.check_room(len(prompt))
    for mine, theirs in zip(grown.layers, restored.layers):
        mine.copy_row(0, theirs, 0, len(prompt))
    grown.positions[0] = len(prompt)
    grown.lengths = [len(prompt)]


def test_eviction_takes_leaves_least_recently_used_first_and_counts_bytes():
    model = tiny("kimi-k3-tiny")
    prefix = PrefixCache(BLOCK)
    g = torch.Generator().manual_seed(2)
    a, b = (torch.randint(0, 97, (24,), generator=g).tolist() for _ in range(2))
    with torch.inference_mode():
        _, cache, _ = prefill(model, a, prefix)
        prefill(model, b, prefix)
    one = prefix.block_bytes(cache)
    assert len(prefix) == 6 and prefix.nbytes == 6 * one
    prefix.lookup(a + [1])  # a's blocks are now the most recently used
    assert prefix.evict(1) == one and len(prefix) == 5
    assert prefix.lookup(b + [1]) and len(prefix.lookup(b + [1])) == 2  # b's last block went first
    assert prefix.evict(10**12) == 5 * one and prefix.nbytes == 0 and len(prefix) == 0
    with pytest.raises(ValueError, match="block"):
        PrefixCache(0)


def run_engine(model, work, **kw) -> list[list[int]]:
    engine = Engine(model, cache_memory=10**9, max_running=8, max_length=128, **kw).start()
    out = []
    try:
        for prompt, n, seed in work:  # one after another: later prompts find the earlier ones' blocks
            done: list[str] = []
            s = Sequence(prompt, n, temperature=0.0 if seed is None else 0.9, seed=seed, on_finish=done.append)
            engine.submit(s)
            while not done:
                time.sleep(0.005)
            assert done == ["length"], done
            out.append(s.tokens)
        deadline = time.time() + 20
        while engine.stats()["slots_free"] != engine.slots or engine.stats()["cache_bytes_reserved"]:
            assert time.time() < deadline, engine.stats()
            time.sleep(0.005)
        return out, engine.stats()["prefix_cache"]
    finally:
        engine.stop()


@pytest.mark.parametrize("preset", ["gpt2-tiny", "kimi-linear-tiny", "kimi-k3-tiny"])
def test_the_engine_gives_the_same_tokens_with_the_prefix_cache_on_and_off(preset):
    model = tiny(preset)
    g = torch.Generator().manual_seed(3)
    system = torch.randint(0, 97, (20,), generator=g).tolist()
    turns = [torch.randint(0, 97, (int(n),), generator=g).tolist() for n in (3, 7, 1, 12)]
    work = [(system + t, 6, None) for t in turns] + [(system + turns[0], 6, 5), (system + turns[1], 6, 7)]
    on, stats = run_engine(model, work, prefill_chunk=BLOCK, prefix_cache=True)
    off, none = run_engine(model, work, prefill_chunk=BLOCK, prefix_cache=False)
    assert on == off and none is None
    assert stats["hits"] == len(work) - 1 and stats["hit_tokens"] >= 2 * BLOCK * (len(work) - 1)


@pytest.mark.parametrize("preset", PRESETS)
def test_pieces_run_together_give_what_each_gives_alone(preset, monkeypatch):
    """Prompts sharing a cached system prompt, admitted in one turn: their equal remainders (and then the
    shorter ones') run as one forward over their rows of the pool, each row at its own position, and every
    sequence gets the tokens it gets alone (greedy and seeded), for every kind of cache."""
    import k3.serve.prefill as prefill_module

    model = tiny(preset)
    g = torch.Generator().manual_seed(4)
    system = torch.randint(0, 97, (2 * BLOCK,), generator=g).tolist()
    turns = [torch.randint(0, 97, (int(n),), generator=g).tolist() for n in (5, 5, 5, 3, 5)]
    work = [(system + t, 5, None if i % 2 else 11 + i) for i, t in enumerate(turns)]
    alone, _ = run_engine(model, [(system, 1, None)] + work, prefill_chunk=BLOCK, prefix_cache=True)
    batches, packed = [], prefill_module.packed_forward

    def counted(model, ids, groups):  # the rows of each group of prompt pieces
        batches.extend(group.count for group in groups if group.picks is None)
        return packed(model, ids, groups)

    monkeypatch.setattr(prefill_module, "packed_forward", counted)
    engine = Engine(
        model,
        cache_memory=10**9,
        max_running=8,
        max_length=128,
        prefill_chunk=64,
        prefix_cache=True,
        prefix_block=BLOCK,
    )
    try:
        engine.start()
        warm = Sequence(system, 1, temperature=0.0)
        engine.submit(warm)
        while warm.finish_reason is None:
            time.sleep(0.005)
        with engine.lock:  # all admitted at once: one turn finds them prefilling together
            sequences = [Sequence(p, n, temperature=0.0 if seed is None else 0.9, seed=seed) for p, n, seed in work]
            for s in sequences:
                engine.submit(s)
        while any(s.finish_reason is None for s in sequences):
            time.sleep(0.005)
    finally:
        engine.stop()
    assert [s.tokens for s in sequences] == alone[1:]
    assert max(batches) == 4  # the four 5-token remainders in one forward
