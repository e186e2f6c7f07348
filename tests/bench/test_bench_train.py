"""`k3 bench train` runs end to end on a tiny corpus: the machine's matmul figure, both models' speed
(interleaved rounds) and their validation after the budget, in the printout and the JSON. No timing is
asserted."""

from __future__ import annotations

import json

import pytest

from k3.bench import train as bench_train

from ..corpus import write_corpus


@pytest.mark.slow  # two models trained for a (tiny) wall-clock budget
def test_tiny_run_reports_speed_and_validation(tmp_path, capsys):
    (tmp_path / "corpus").mkdir()
    corpus = write_corpus(tmp_path / "corpus", docs=6, words=2000)
    out = tmp_path / "train.json"
    results = bench_train.run(
        minutes=0.02, speed_steps=1, out=str(tmp_path / "runs"), json_path=str(out), data=str(corpus)
    )
    text = capsys.readouterr().out
    assert "GFLOP/s (1024^3 float32)" in text and "trains at" in text and "validation bits per byte" in text
    assert set(results) == {"kimi-k3-tiny", "gpt2-tiny"}
    for r in results.values():
        assert r["tokens_per_s"] > 0 and r["steps"] >= 1 and 0 < r["val_bpb"] < 20 and r["parameters"] > 0
    saved = json.loads(out.read_text())
    assert saved["speed_ratio"] == results["kimi-k3-tiny"]["tokens_per_s"] / results["gpt2-tiny"]["tokens_per_s"]
