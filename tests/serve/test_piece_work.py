"""A prefill piece's work (`prefill_macs`) and the most tokens a given work buys (`tokens_within`)."""

from __future__ import annotations

import pytest

from k3.models import get_config
from k3.serve.sequence import prefill_macs, prefill_macs_terms, tokens_within


@pytest.mark.parametrize("preset", ["kimi-k3-tiny", "gpt2-tiny", "kimi-linear-tiny", "gated-deltanet-tiny"])
def test_tokens_within_is_the_largest_piece_whose_work_fits(preset):
    terms = prefill_macs_terms(get_config(preset))
    budget = prefill_macs(terms, 512, 0)
    for context in (0, 1, 100, 4096, 100_000):
        n = tokens_within(terms, budget, context)
        assert prefill_macs(terms, n, context) <= budget < prefill_macs(terms, n + 1, context)
    assert tokens_within(terms, budget, 0) == 512


def test_attention_makes_a_late_token_dearer_and_a_linear_mixer_does_not():
    mla, linear = (prefill_macs_terms(get_config(p)) for p in ("kimi-k3-tiny", "gated-deltanet-tiny"))
    assert mla[1] > 0 and linear[1] == 0
    assert prefill_macs(mla, 64, 8192) > 2 * prefill_macs(mla, 64, 0)
    assert prefill_macs(linear, 64, 8192) == prefill_macs(linear, 64, 0)
