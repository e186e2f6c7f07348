"""k3 lab lineage: a smoke run trains every lineage model at one width and reports curves, parameters and
decode state; the lineage is the article's, at one width; the interpolation and the verdicts follow their
stated rules."""

from __future__ import annotations

import json

import pytest

import k3.lab
from k3.lab.lineage import CHAIN, HYBRIDS, LINEAGE, _claims, bpb_at, lineage_configs
from k3.models import count_params


def test_smoke_run_trains_every_model_and_writes_its_section(tmp_path):
    result = k3.lab.run("lineage", "smoke", tmp_path)
    (table,) = result.tables
    assert [row[0] for row in table.rows] == list(LINEAGE)
    assert len(result.claims) == 2 and len(result.figures) == 1
    assert (tmp_path / result.figures[0].path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((tmp_path / "lab" / "lineage.json").read_text())
    for name, run in saved["data"].items():
        assert run["steps"] == 4 and run["tokens"][-1] == 4 * 2 * 32  # 4 steps of 2 x 32 tokens
        assert run["tokens"] == sorted(run["tokens"]) and run["seconds"] == sorted(run["seconds"])
        assert 0 < run["seconds"][-1] <= run["train_seconds"] + 1e-9
        assert all(0 < b < 9 for b in run["bpb"]) and 0 < run["final_bpb"] < 9  # bytes: < 8 bits + slack
        assert run["parameters"] > run["active"] > 0
    # the hybrids and linear mixers hold a fixed state; GPT-2's cache grows with the context
    data = saved["data"]
    assert data["GPT-2"]["decode_state_bytes"] > max(data[n]["decode_state_bytes"] for n in CHAIN)
    assert "The lineage on language modelling" in (tmp_path / "results.md").read_text()


def test_lineage_at_one_width_in_the_articles_order():
    configs = lineage_configs(192, 4096)
    assert list(configs) == ["GPT-2", "linear attention", "DeltaNet", "Gated DeltaNet", "KDA", "Kimi Linear", "Kimi K3"]
    assert {c.hidden_size for c in configs.values()} == {192}
    kinds = {name: set(c.layer_types) for name, c in configs.items()}
    assert kinds["GPT-2"] == {"mha"} and kinds["KDA"] == {"kda"} and kinds["Gated DeltaNet"] == {"gated_deltanet"}
    assert kinds["Kimi K3"] == kinds["Kimi Linear"] == {"kda", "mla"}
    assert count_params(configs["Kimi K3"]).active < count_params(configs["Kimi K3"]).total
    shallow = lineage_configs(32, 256, num_layers=2)
    assert {c.num_layers for c in shallow.values()} == {2} and set(shallow["KDA"].layer_types) == {"kda"}


def test_bpb_at_reads_the_curve_linearly_between_evaluations():
    curve = {"tokens": [100, 300], "bpb": [3.0, 2.0]}
    assert bpb_at(curve, 200) == pytest.approx(2.5)
    assert bpb_at(curve, 50) == 3.0 and bpb_at(curve, 400) == 2.0 and bpb_at(curve, 300) == 2.0


def _data(final: dict) -> dict:
    return {n: {"final_bpb": final[n], "bpb_at_fewest_tokens": final[n], "decode_state_bytes": 1.0} for n in LINEAGE}


def test_verdicts_follow_their_thresholds():
    falling = {
        "GPT-2": 2.5,
        "linear attention": 2.6,
        "DeltaNet": 2.5,
        "Gated DeltaNet": 2.4,
        "KDA": 2.3,
        "Kimi Linear": 2.2,
        "Kimi K3": 2.1,
    }
    chain, hybrids = _claims(_data(falling), 1000, "1 min")
    assert chain.verdict == "holds" and hybrids.verdict == "holds"
    one_flat = {**falling, "Gated DeltaNet": 2.5, "KDA": 2.4}  # one step (DeltaNet -> Gated DeltaNet) fails
    assert _claims(_data(one_flat), 1000, "1 min")[0].verdict == "partly"
    rising = {**falling, "DeltaNet": 2.7, "Gated DeltaNet": 2.8, "KDA": 2.9}
    assert _claims(_data(rising), 1000, "1 min")[0].verdict == "does not hold"
    one_hybrid = {**falling, HYBRIDS[0]: 2.6}
    assert _claims(_data(one_hybrid), 1000, "1 min")[1].verdict == "partly"
    worse = {**falling, "Kimi Linear": 2.6, "Kimi K3": 2.7}
    assert _claims(_data(worse), 1000, "1 min")[1].verdict == "does not hold"
