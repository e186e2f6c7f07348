"""Prompts of different lengths generated as one batch: every row equals generating its prompt alone
(greedy, float64), for every tiny preset (hybrid KDA + MLA with MoE and Block AttnRes, pure linear,
GPT-2 with learned positions) and for MLA with rotary positions; the joined cache masks the empty
slots of the shorter rows; eos ends each row on its own."""

from __future__ import annotations

import pytest
import torch

from k3.models import Cache

from .conftest import TINY, tiny_model

LENGTHS = [5, 1, 9, 5, 3]  # equal lengths too (prefilled as one batch), and a one-token prompt


def prompts(lengths=LENGTHS, vocab: int = 512, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("name, overrides", [(name, {}) for name in TINY] + [("kimi-k3-tiny", {"rope_theta": 10000.0})])
def test_each_row_equals_generating_it_alone(name, overrides):
    model = tiny_model(name, **overrides).double()
    batch = prompts()
    together = model.generate(batch, max_new_tokens=7, temperature=0)
    assert isinstance(together, list) and len(together) == len(batch)
    for prompt, row in zip(batch, together):
        alone = model.generate(torch.tensor([prompt]), max_new_tokens=7, temperature=0)[0]
        assert torch.equal(row, alone), (prompt, row, alone)


def test_joined_cache_logits_equal_each_rows_own():
    """The decode step's logits from a joined cache equal each row's own cache's, to float64 rounding."""
    model = tiny_model("kimi-k3-tiny").double()
    rows = [torch.tensor([p]) for p in prompts([4, 7, 2])]
    caches = [model.new_cache(1) for _ in rows]
    for ids, cache in zip(rows, caches):
        model(ids, cache=cache)
    joined = Cache.concat(caches)
    assert joined.batch_size == 3 and joined.length == 7 and joined.lengths == [4, 7, 2]
    assert joined.positions.tolist() == [4, 7, 2]  # each row left-aligned at its own position
    step = torch.tensor([[1], [2], [3]])
    together = model(step, cache=joined)
    for i, cache in enumerate(caches):
        torch.testing.assert_close(together[i], model(step[i : i + 1], cache=cache)[0], rtol=1e-12, atol=1e-12)
    assert joined.lengths == [5, 8, 3]


def test_eos_ends_each_row_and_bad_prompts_are_refused():
    model = tiny_model("gpt2-tiny").double()
    batch = prompts([3, 6])
    free = model.generate(batch, max_new_tokens=6, temperature=0)
    eos = int(free[0][3 + 1])  # row 0's second new token
    out = model.generate(batch, max_new_tokens=6, temperature=0, eos_token_id=eos)
    first = int((free[0][3:] == eos).nonzero()[0]) + 1
    assert torch.equal(out[0], free[0][: 3 + first])  # cut after its first eos
    row1_eos = (free[1][6:] == eos).nonzero()
    assert out[1].numel() == 6 + (int(row1_eos[0]) + 1 if len(row1_eos) else 6)
    with pytest.raises(ValueError, match="prompt 1 must be a non-empty"):
        model.generate([[1, 2], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="empty"):
        model.generate([], max_new_tokens=2)
    with pytest.raises(ValueError, match="different models"):
        Cache.concat([model.new_cache(1), tiny_model("kimi-k3-tiny").new_cache(1)])
