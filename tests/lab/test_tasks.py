"""The synthetic recall tasks: every target is the answer an oracle reading only the past would give, and the
answer is never visible at the position that must predict it."""

import pytest
import torch

from k3.lab.tasks import FIRST_KEY, IGNORE, NONE, PAD, SWITCH, Vocab, context_switch, mqar, overwrite

VOCAB = Vocab(num_keys=16, num_values=12)


def oracle(inputs: torch.Tensor, upto: int) -> dict[int, int]:
    """Bindings visible in inputs[:upto + 1]: a key token followed by a value token binds it; SWITCH forgets all.
    Only the binding region counts (before the queries), which the tests pass as `upto`."""
    bound: dict[int, int] = {}
    for t in range(upto):
        a, b = int(inputs[t]), int(inputs[t + 1])
        if a == SWITCH:
            bound = {}
        elif FIRST_KEY <= a < VOCAB.first_value and b >= VOCAB.first_value:
            bound[a] = b
    return bound


def first_query(targets: torch.Tensor) -> int:
    return int((targets != IGNORE).nonzero()[0])


def check(batch, expect_stale: bool = False):
    inputs, targets = batch.inputs, batch.targets
    assert inputs.shape == targets.shape == batch.kind.shape
    for row in range(inputs.shape[0]):
        start = first_query(targets[row])
        # before the queries: bindings and filler only; no scored position
        bound = oracle(inputs[row], start - 1)
        scored = (targets[row] != IGNORE).nonzero().flatten().tolist()
        assert scored, "every sequence asks something"
        seen_before = set()
        for pos in scored:
            key, answer = int(inputs[row, pos]), int(targets[row, pos])
            assert FIRST_KEY <= key < VOCAB.first_value, "a query is a key token"
            assert answer != key and answer != PAD
            assert answer == bound.get(key, NONE), "target = the latest visible binding (NONE if dropped)"
            assert key not in seen_before, "each key is asked once"
            seen_before.add(key)
            if pos + 1 < inputs.shape[1]:
                assert int(inputs[row, pos + 1]) == answer, "teacher forcing: the answer follows its query"
            # no leakage: within the query region, the answer never appears before its query
            region = inputs[row, start : pos + 1].tolist()
            own = [i for i, tok in enumerate(region) if tok == answer]
            assert all(i % 2 == 1 for i in own), "an answer token in the query region only as another answer"
        stale = [int(batch.kind[row, p]) == 2 for p in scored]
        if expect_stale:
            assert all((int(targets[row, p]) == NONE) == s for p, s in zip(scored, stale))


@pytest.mark.parametrize("pairs,seq_len", [(1, 3), (3, 11), (8, 40), (16, 64)])
def test_mqar_answers_are_the_bound_values(pairs, seq_len):
    b = mqar(6, seq_len, pairs, VOCAB, generator=torch.Generator().manual_seed(pairs))
    check(b)
    assert int((b.targets != IGNORE).sum()) == 6 * pairs
    keys = b.inputs[:, 0 : 2 * pairs : 2]
    assert all(len(set(r.tolist())) == pairs for r in keys), "keys in one context are distinct"


def test_mqar_num_queries_and_determinism():
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a, b = mqar(4, 32, 6, VOCAB, num_queries=2, generator=g1), mqar(4, 32, 6, VOCAB, num_queries=2, generator=g2)
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert int((a.targets != IGNORE).sum()) == 8
    check(a)


def test_overwrite_latest_binding_wins():
    b = overwrite(8, 48, 6, 3, VOCAB, generator=torch.Generator().manual_seed(1))
    check(b)
    kinds = b.kind[b.targets != IGNORE]
    assert int((kinds == 2).sum()) == 8 * 3 and int((kinds == 1).sum()) == 8 * 3
    # a re-bound key's old value differs from its new one, so the stale answer is always wrong
    for row in range(8):
        first = {int(b.inputs[row, t]): int(b.inputs[row, t + 1]) for t in range(0, 12, 2)}
        for pos in (b.kind[row] == 2).nonzero().flatten().tolist():
            assert first[int(b.inputs[row, pos])] != int(b.targets[row, pos])


def test_context_switch_forgets_and_rebinds():
    b = context_switch(8, 64, 6, VOCAB, generator=torch.Generator().manual_seed(2))
    check(b, expect_stale=True)
    assert (b.inputs == SWITCH).sum(1).eq(1).all()
    assert ((b.kind == 2) & (b.targets != IGNORE)).any(), "some stale keys are asked"


@pytest.mark.parametrize(
    "call,name",
    [
        (lambda: mqar(2, 10, 3, VOCAB), "seq_len"),
        (lambda: mqar(2, 64, 17, VOCAB), "num_pairs"),
        (lambda: overwrite(2, 64, 4, 5, VOCAB), "num_rebound"),
        (lambda: context_switch(2, 64, 9, VOCAB), "num_pairs"),
    ],
)
def test_bad_sizes_name_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()
