"""One pool, one forward a turn: rows addressed by index (`RowsCache`, a view's `live` rows), a turn's
decode tokens and prompt pieces packed into one forward (`k3.inference.packed`), each row computing what it
computes alone; the engine runs one forward a turn under its token budget."""

from __future__ import annotations

import pytest
import torch

import k3.serve.prefill as prefill_module
from k3.inference.packed import Group, packed_forward
from k3.inference.row_cache import RowsCache
from k3.models import PRESETS, CausalLM, get_config
from k3.serve import Engine
from k3.serve.sequence import prefill_macs

from .test_engine import Collector, alone, wait_until

TINY = [name for name in PRESETS if name.endswith("-tiny")]


def tiny(preset: str) -> CausalLM:
    torch.manual_seed(0)
    overrides = {"max_position_embeddings": 128} if preset == "gpt2-tiny" else {}
    return CausalLM(get_config(preset, vocab_size=97, hidden_size=32, **overrides)).double().eval()


def last_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens]))[0, -1]


def states(pool, row: int) -> list[torch.Tensor]:
    return [t[row].clone() for layer in pool.layers for t in layer.states()] + [pool.positions[row].clone()]


@pytest.mark.parametrize("preset", TINY)
def test_a_packed_turn_gives_each_row_its_own_forward(preset):
    """Two decoding rows (given out of order), two 7-token pieces together by row index, a 4-token piece and a
    1-token piece alone, packed into one forward: each position's logits are those of the row's own full
    forward (float64), the rows continue from the right state, and a row outside the turn is left as it was."""
    model = tiny(preset)
    g = torch.Generator().manual_seed(1)
    prompt = {r: torch.randint(0, 97, (30,), generator=g).tolist() for r in range(7)}
    pool = model.new_cache(7, max_length=64)
    with torch.inference_mode():
        for r, n in ((0, 10), (2, 10), (6, 3)):  # prefilled before the turn, alone
            row = pool.view(1, 64, first=r)
            row.lengths = [0]
            model(torch.tensor([prompt[r][:n]]), cache=row)
        untouched = states(pool, 6)
        live = torch.tensor([True, False, True, False, False, False, False])
        decoding = pool.view(4, 64)
        decoding.live, decoding.lengths = live[:4], [10, 0, 10, 0]
        together = RowsCache(pool, [5, 3], [0, 0])
        four, one = pool.view(1, 64, first=1), pool.view(1, 64, first=4)
        four.lengths = one.lengths = [0]
        groups = [
            Group(decoding, 2, 1, torch.tensor([2, 0])),
            Group(together, 2, 7),
            Group(four, 1, 4),
            Group(one, 1, 1),
        ]
        ids = [prompt[2][10], prompt[0][10], *prompt[5][:7], *prompt[3][:7], *prompt[1][:4], prompt[4][0]]
        logits = model.lm_head(packed_forward(model, torch.tensor(ids), groups))
        expected = [(0, prompt[2][:11]), (1, prompt[0][:11]), (8, prompt[5][:7]), (15, prompt[3][:7])]
        expected += [(19, prompt[1][:4]), (20, prompt[4][:1])]
        for at, tokens in expected:
            torch.testing.assert_close(logits[at], last_logits(model, tokens), rtol=0, atol=1e-12)
        assert pool.positions.tolist() == [11, 4, 11, 7, 1, 7, 3]
        for got, before in zip(states(pool, 6), untouched):
            assert torch.equal(got, before)  # not in the turn: not written
        for r, n in ((5, 7), (3, 7), (1, 4), (4, 1), (0, 11)):  # each row goes on from its own state
            row = pool.view(1, 64, first=r)
            row.lengths = [n]
            out = model(torch.tensor([prompt[r][n : n + 5]]), cache=row)[0, -1]
            torch.testing.assert_close(out, last_logits(model, prompt[r][: n + 5]), rtol=0, atol=1e-12)


def test_a_failed_rows_forward_leaves_the_pool_as_it_was():
    """A forward through `RowsCache` that fails half-way writes nothing of the rows' states or positions back:
    they are written (`commit`) only once it succeeded."""
    model = tiny("kimi-k3-tiny")
    pool = model.new_cache(3, max_length=32)
    with torch.inference_mode():
        rows = RowsCache(pool, [2, 0], [0, 0])
        model(torch.tensor([[1, 2, 3], [4, 5, 6]]), cache=rows)
        rows.commit()
        before = states(pool, 0) + states(pool, 2)
        broken = RowsCache(pool, [0, 2], [3, 3])
        with pytest.raises(ValueError, match="input_ids"):
            model(torch.tensor([[7, 8], [9, 999]]), cache=broken)
        assert all(torch.equal(a, b) for a, b in zip(states(pool, 0) + states(pool, 2), before))


@pytest.mark.parametrize("budget", [None, 40])
def test_the_engine_runs_one_forward_a_turn_within_its_token_budget(budget, monkeypatch):
    """Running rows decode while long prompts prefill: every turn is one forward (the packed one when a prompt
    has a piece, else the decode step), the packed forward holds every running row's token beside the
    pieces and at most `max_num_batched_tokens` tokens; each sequence gets its tokens alone."""
    model = tiny("kimi-k3-tiny")
    forwards, turns, real_packed = [], [0], prefill_module.packed_forward

    def packed(model, ids, groups):
        forwards.append(("packed", len(ids), groups[0].picks is not None, turns[0]))
        return real_packed(model, ids, groups)

    monkeypatch.setattr(prefill_module, "packed_forward", packed)
    engine = Engine(model, cache_memory=10**9, max_running=8, max_length=128, prefill_chunk=64,
                    max_num_batched_tokens=budget).start()  # fmt: skip
    real_decode, real_turn = engine.pool.decode, engine.prefiller.turn
    monkeypatch.setattr(engine.pool, "decode", lambda *a: forwards.append(("decode", turns[0])) or real_decode(*a))
    monkeypatch.setattr(engine.prefiller, "turn", lambda rows: turns.__setitem__(0, turns[0] + 1) or real_turn(rows))
    g = torch.Generator().manual_seed(2)
    work = [(torch.randint(0, 97, (n,), generator=g).tolist(), m) for n, m in ((5, 30), (6, 30), (100, 4), (90, 3))]
    try:
        collectors = []
        for i, (prompt, n) in enumerate(work):
            if i == 2:
                wait_until(lambda: engine.steps >= 2)  # the long prompts arrive while two rows decode
            collectors.append(Collector())
            engine.submit(collectors[-1].sequence(prompt, n))
        for (prompt, n), c in zip(work, collectors):
            assert c.done.wait(120) and c.reason == "length" and c.tokens == alone(model, prompt, n)
    finally:
        engine.stop()
    each = [f[-1] for f in forwards]
    assert len(each) == len(set(each)) and len(each) > 10  # one forward a turn
    mixed = [f for f in forwards if f[0] == "packed" and f[2]]  # decode rows beside prompt pieces
    assert mixed and all(f[1] <= (budget or 4 + 64) for f in mixed)
    if budget:
        assert all(f[1] <= budget for f in forwards if f[0] == "packed")


def test_a_piece_deep_in_a_long_prompt_is_sized_by_its_work(monkeypatch):
    """A turn's prompt pieces do at most the work (`prefill_macs`) of `prefill_chunk` tokens at a prompt's
    start: late in a long prompt, where each token attends to every slot before it, a piece holds fewer
    tokens; the prompt still gets its tokens alone, while a short request beside it decodes."""
    model = tiny("kimi-k3-tiny")
    pieces, real_packed = [], prefill_module.packed_forward

    def packed(model, ids, groups):
        pieces.append([(g.tokens, length) for g in groups if g.picks is None for length in g.cache.lengths])
        return real_packed(model, ids, groups)

    monkeypatch.setattr(prefill_module, "packed_forward", packed)
    engine = Engine(model, cache_memory=10**9, max_running=4, max_length=1200, prefill_chunk=128,
                    prefix_cache=False).start()  # fmt: skip
    g = torch.Generator().manual_seed(3)
    long, short = torch.randint(0, 97, (1100,), generator=g).tolist(), [5, 6, 7]
    try:
        first, second = Collector(), Collector()
        engine.submit(first.sequence(short, 40))
        engine.submit(second.sequence(long, 3))
        assert second.done.wait(300) and second.tokens == alone(model, long, 3)
        assert first.done.wait(60) and first.tokens == alone(model, short, 40)
    finally:
        engine.stop()
    terms, most = engine.prefiller.terms, engine.prefiller.turn_macs
    for turn in pieces:
        assert sum(prefill_macs(terms, n, context) for n, context in turn) <= most * (1 + 1e-9)
    sizes = {context: n for turn in pieces for n, context in turn}
    late = [n for context, n in sizes.items() if 700 <= context < 900]  # more than a piece left
    assert 40 < sizes[0] < 80 and late and max(late) < 0.6 * sizes[0], sizes  # its first piece (half the work: long)


def test_the_token_budget_and_the_threads_are_checked():
    with pytest.raises(ValueError, match="`max_num_batched_tokens` must be an int >= 1, got 0"):
        Engine(tiny("gpt2-tiny"), cache_memory=10**8, max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="`threads` must be an int >= 1, got 0"):
        Engine(tiny("gpt2-tiny"), cache_memory=10**8, threads=0)
