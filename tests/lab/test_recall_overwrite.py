"""The recall and overwrite experiments: smoke runs write their section and figure; the verdicts follow the
measurements (they are computed, never fixed)."""

import json

from k3 import lab
from k3.lab import overwrite, recall
from k3.lab.synthetic import MIXERS, Size, mixer_config


def test_mixer_configs_differ_only_in_the_mixer():
    size = Size(width=32, layers=4, head_dim=8)
    configs = {m: mixer_config(m, 100, size) for m in MIXERS}
    assert configs["kda+mla"].layer_types == ["kda", "kda", "kda", "mla"]
    assert configs["softmax"].layer_types == ["mha"] * 4
    for c in configs.values():
        assert (c.hidden_size, c.num_layers, c.vocab_size, c.intermediate_size) == (32, 4, 100, 64)


def test_recall_smoke(tmp_path):
    result = lab.run("recall", "smoke", tmp_path)
    assert (tmp_path / "figures" / "recall.png").stat().st_size > 1000
    assert len(result.claims) == 4 and len(result.tables[0].rows) == len(MIXERS)
    saved = json.loads((tmp_path / "lab" / "recall.json").read_text())
    assert set(saved["data"]["accuracy"]["D=4,T=24"]) == set(MIXERS)
    assert "## Associative recall" in (tmp_path / "results.md").read_text()


def test_overwrite_smoke(tmp_path):
    result = lab.run("overwrite", "smoke", tmp_path)
    assert (tmp_path / "figures" / "overwrite.png").exists()
    assert len(result.claims) == 3 and len(result.tables[0].header) == 5


def _scores(value):
    return {m: {p: value(m, p) for p in (1, 2, 4, 8, 12)} for m in MIXERS}


def test_recall_verdicts_follow_the_numbers():
    # linear attention collapses past D = 4; everyone else holds: every claim holds
    good = recall.judge(_scores(lambda m, p: 0.2 if m == "linear_attn" and p > 4 else
                                (0.5 if m == "kda" and p > 4 else 1.0)), 4)
    assert [c.verdict for c in good] == ["holds"] * 4
    # nobody learned anything: nothing is measurable
    flat = recall.judge(_scores(lambda m, p: 0.03), 4)
    assert all(c.verdict == "not measurable here" for c in flat)
    # linear attention does as well as everyone: its claim does not hold
    same = recall.judge(_scores(lambda m, p: 1.0), 4)
    assert same[0].verdict == "does not hold"


def test_overwrite_verdicts_follow_the_numbers():
    labels = [label for _, _, label in overwrite.COLUMNS]
    base = {m: dict.fromkeys(labels, 0.9) for m in MIXERS}
    base["linear_attn"][labels[1]] = 0.3
    base["deltanet"][labels[3]] = 0.1
    verdicts = [c.verdict for c in overwrite.judge(base)]
    assert verdicts[:2] == ["holds", "holds"] and verdicts[2] == "does not hold"


def test_a_mixer_that_did_not_learn_makes_only_its_claims_unmeasurable():
    scores = _scores(lambda m, p: 0.03 if m in ("kda", "kda+mla") else (0.2 if m == "linear_attn" and p > 4 else 1.0))
    verdicts = [c.verdict for c in recall.judge(scores, 4)]
    assert verdicts == ["holds", "holds", "not measurable here", "holds"]
