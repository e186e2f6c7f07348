"""Every tiny preset's logits, pinned: a refactor of the model code (the forward, the caches, the decode path)
must give the same numbers for the same weights (float64, 1e-12). The weights are drawn from each parameter's
name, not from the order the modules make them, so a refactor that builds the same parameters in another order
still compares. The fixture holds, per preset, a slice of the full forward's logits and their log-sum-exp at
every position, the training loss, and the logits of a prefill followed by decode steps through a cache.

Rewrite it (only when a change is meant to change the numbers, and say so in the commit):
    K3_WRITE_LOGITS_FIXTURE=1 python -m pytest tests/models/test_logits_fixture.py
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest
import torch

from k3.models import PRESETS, CausalLM, get_config

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "logits.pt"
TINY = [name for name in PRESETS if name.endswith("-tiny")]
B, T, PREFILL, SLICE = 2, 37, 30, 24


def named_weights_model(name: str) -> CausalLM:
    """The preset at vocabulary 512 in float64, every parameter drawn from a generator seeded by its name."""
    model = CausalLM(get_config(name, vocab_size=512)).double().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(pname.encode()))
            values = torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.copy_(1 + 0.1 * values if pname.endswith("norm.weight") else 0.05 * values)
    return model


def measure(name: str) -> dict[str, torch.Tensor]:
    model = named_weights_model(name)
    ids = torch.randint(0, 512, (B, T), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = model(ids)
        loss = model(ids[:, :-1], targets=ids[:, 1:])
        cache = model.new_cache(B)
        steps = [model(ids[:, :PREFILL], cache=cache)[:, -1]]
        for t in range(PREFILL, T):
            steps.append(model(ids[:, t : t + 1], cache=cache)[:, -1])
    steps = torch.stack(steps, 1)
    return {
        "logits": logits[..., :SLICE].clone(),
        "logsumexp": logits.logsumexp(-1),
        "loss": loss.reshape(1),
        "decode": steps[..., :SLICE].clone(),
        "decode_logsumexp": steps.logsumexp(-1),
    }


def test_write_fixture_when_asked():
    if os.environ.get("K3_WRITE_LOGITS_FIXTURE") != "1":
        pytest.skip("the fixture is written only with K3_WRITE_LOGITS_FIXTURE=1")
    torch.save({name: measure(name) for name in TINY}, FIXTURE)


@pytest.mark.parametrize("name", TINY)
def test_logits_equal_the_fixture(name):
    want = torch.load(FIXTURE, weights_only=True)[name]
    got = measure(name)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-12, atol=1e-12, msg=f"{name}: {key}")
