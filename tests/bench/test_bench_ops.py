"""`k3 bench ops` runs end to end on a tiny shape and reports every case it promises."""

from __future__ import annotations

import io
import json

from k3.bench import ops
from k3.cli import main


def test_bench_ops_tiny_run(tmp_path, capsys):
    """The CLI times recurrent, chunk and SDPA for each length and writes them as JSON."""
    out = tmp_path / "bench.json"
    rc = main(
        [
            "bench",
            "ops",
            "--T",
            "40",
            "70",
            "--chunk-sizes",
            "16",
            "32",
            "--heads",
            "2",
            "--dim",
            "8",
            "--repeats",
            "1",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "machine matmul" in text and "T = 70: causal SDPA" in text
    assert text.count("chunk C=32") == 4  # two mixers x two lengths
    data = json.loads(out.read_text())
    assert [row["T"] for row in data["results"]] == [40, 70]
    for row in data["results"]:
        for entry in row["ops"].values():
            assert entry["recurrent_s"] > 0 and set(entry["chunk_s"]) == {"16", "32"}


def test_model_flops_is_the_articles_formula():
    """2*L*d^2 + 2*L*C*d per head."""
    assert ops.model_flops(T=100, H=3, d=8, C=16) == 3 * (2 * 100 * 64 + 2 * 100 * 16 * 8)


def test_run_prints_speedups():
    buf = io.StringIO()
    ops.run(lengths=(33,), chunk_sizes=(8,), heads=1, dim=4, repeats=1, out=buf)
    assert "x vs recurrent" in buf.getvalue() and "x SDPA time" in buf.getvalue()
