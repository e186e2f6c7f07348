"""`k3 lab decode`: the smoke run, and the filled caches it decodes from."""

from __future__ import annotations

import json

import pytest
import torch

import k3.lab
from k3.lab import decode
from k3.lab.decode.measure import (
    ALL_KDA,
    BASELINE,
    MODELS,
    WIDTH,
    build_models,
    expected_bytes,
    fill_cache,
    layout,
    prefill_cache,
    time_steps,
)
from k3.lab.report import VERDICTS


@pytest.fixture(scope="module")
def models():
    return build_models(max_length=256)


def test_smoke_run_writes_claims_tables_figures(tmp_path):
    result = k3.lab.run("decode", "smoke", tmp_path)
    assert len(result.claims) == 4 and all(c.verdict in VERDICTS for c in result.claims)
    # the bytes claims are exact counts, whatever the machine's noise
    assert result.claims[0].verdict == "holds" and result.claims[1].verdict == "holds"
    assert len(result.tables) == 4 and all(t.rows for t in result.tables)
    assert (tmp_path / result.figures[0].path).stat().st_size > 1000
    saved = json.loads((tmp_path / "lab" / "decode.json").read_text())
    assert saved["name"] == "decode" and saved["setup"]["lengths"] == [64, 128, 256]
    assert "k3 lab decode --smoke" in (tmp_path / "results.md").read_text()


def test_models_share_the_width(models):
    assert list(models) == list(MODELS)
    assert {m.config.hidden_size for m in models.values()} == {WIDTH}
    assert set(models[ALL_KDA].config.layer_types) == {"kda"}
    assert models[BASELINE].config.max_position_embeddings == 256


def test_filled_cache_has_the_layout_of_a_prefill(models):
    """Same tensors, shapes, dtypes and bytes as really running N tokens, and the config's byte count."""
    gen = torch.Generator().manual_seed(0)
    for name, model in models.items():
        filled, real = fill_cache(model, 40, gen), prefill_cache(model, 40, gen)
        assert layout(filled) == layout(real), name
        assert filled.length == real.length == 40
        assert filled.nbytes_by_type(held=True) == real.nbytes_by_type(held=True) == expected_bytes(model, 40), name


def test_decoding_from_a_filled_cache_grows_it_by_one_token(models):
    gen = torch.Generator().manual_seed(0)
    model = models["kimi-linear-tiny"]
    cache = fill_cache(model, 32, gen)
    before = cache.nbytes_by_type(held=True)
    with torch.inference_mode():
        logits = model(torch.ones(1, 1, dtype=torch.long), cache=cache)
    assert torch.isfinite(logits).all() and cache.length == 33
    after = cache.nbytes_by_type(held=True)
    assert after["kda"] == before["kda"]  # the recurrent state does not grow
    assert after["mla"] - before["mla"] == 2 * (32 + 16) * 4  # two MLA layers, (kv_lora + rope) floats each


def test_time_steps_is_round_robin_medians(models):
    gen = torch.Generator().manual_seed(0)
    entries = {name: (model, fill_cache(model, 16, gen)) for name, model in models.items()}
    times = time_steps(entries, warmup=1, steps=2)
    assert set(times) == set(models) and all(t > 0 for t in times.values())
    assert all(cache.length == 16 + 3 for _, cache in entries.values())


def test_fit_line():
    a, b = decode.fit_line([1.0, 2.0, 4.0], [3.0, 5.0, 9.0])
    assert a == pytest.approx(1.0) and b == pytest.approx(2.0)
    assert decode.fit_line([1.0, 2.0], [2.0, 1.0])[1] == 0.0  # falling data: a flat line
    a, b = decode.fit_line([1.0, 2.0, 4.0], [1.0, 3.0, 7.0])  # the free fit's a would be -1
    assert a == 0.0 and b > 0


def test_bad_arguments_are_named(models):
    with pytest.raises(ValueError, match="`length` must be at least 8"):
        fill_cache(models["gpt2-tiny"], 4, torch.Generator())
    with pytest.raises(ValueError, match="two or more"):
        decode.fit_line([1.0], [1.0])
    with pytest.raises(ValueError, match="takes no options"):
        decode.run("smoke", None, checkpoint="x")
