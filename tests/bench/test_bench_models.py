"""`k3 bench models` runs end to end on tiny settings: every row, column, JSON figure and target is there,
transformers' rows appear when it is installed (its Kimi Linear after the logits check), and are skipped
with a note when it is not. No timing is asserted."""

from __future__ import annotations

import io
import json
import sys

import pytest

from k3.bench import models
from k3.cli import main

TINY = [
    "--contexts",
    "8",
    "16",
    "--prefill",
    "16",
    "--train",
    "2",
    "8",
    "--batch",
    "1",
    "3",
    "--rounds",
    "1",
    "--steps",
    "2",
]
K3_ROWS = (models.K3_TINY, models.KIMI_LINEAR, models.GPT2)

try:
    import transformers
except ImportError:
    transformers = None
KIMI = transformers is not None and hasattr(transformers, "KimiLinearForCausalLM")


def test_cli_tiny_run_reports_every_model_and_figure(tmp_path, capsys):
    out = tmp_path / "models.json"
    assert main(["bench", "models", "--quick", *TINY, "--threads", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "GFLOP/s (1024^3 float32 GEMM)" in text and "1 thread;" in text
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("| model |"))
    columns = (
        "parameters",
        "prefill 16",
        "train step 2x8",
        "decode @8",
        "decode @16",
        "decode batch 3 (tok/s: x batch 1)",
    )
    for column in columns:
        assert column in header, column
    expected = list(K3_ROWS) + ([models.HF_GPT2] if transformers else []) + ([models.HF_KIMI] if KIMI else [])
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| model")]
    assert [row.split(" | ")[0][2:] for row in rows] == [models.LABELS[name] for name in expected]
    assert all(row.count(" | ") == header.count(" | ") for row in rows)
    assert "targets (issue 13):" in text and ("-> yes" in text or "-> no" in text)

    data = json.loads(out.read_text())
    assert data["threads"] == 1 and data["gemm_gflops"] > 0
    assert data["settings"]["contexts"] == [8, 16] and data["settings"]["train"] == [2, 8]
    assert list(data["models"]) == expected
    for name, r in data["models"].items():
        assert r["parameters"] > 0 and r["prefill_s"] > 0 and r["train_step_s"] > 0 and r["train_tokens_per_s"] > 0
        assert set(r["decode_s"]) == {"8", "16"} and all(t > 0 for t in r["decode_s"].values())
        ratio = data["ratios_vs_gpt2"][name]
        assert ratio["prefill"] > 0 and ratio["train_step"] > 0 and set(ratio["decode"]) == {"8", "16"}
        if name in K3_ROWS:
            assert set(r["batch_decode_s"]) == {"1", "3"} and r["batch_speedup"] > 0
        else:
            assert "batch_speedup" not in r
    assert data["ratios_vs_gpt2"][models.GPT2]["prefill"] == 1.0
    targets = {t["target"]: t for t in data["targets"]}
    assert len([t for t in targets if t.startswith("kimi-k3-tiny decode at") and "context <=" in t]) == 2
    assert len([t for t in targets if "batch 3 >= 4x batch 1" in t]) == 3
    assert all(isinstance(t["holds"], bool) and t["measured"] > 0 for t in data["targets"])
    if KIMI:
        check = data["kimi_linear_logits_check"]
        assert check["passes"] and check["relative_error"] <= 1e-5
        assert "KimiLinearForCausalLM loads kimi-linear-tiny's weights" in text
        assert len([t for t in targets if "faster than transformers' KimiLinearForCausalLM" in t]) == 2
        assert "k3's kimi-linear-tiny against transformers KimiLinearForCausalLM" in text


def test_without_transformers_its_rows_are_skipped_with_a_note(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails as if not installed
    buf = io.StringIO()
    report = models.run(
        contexts=(8,),
        prefill=8,
        train=(1, 8),
        batch=(1, 2),
        rounds=1,
        steps=1,
        warmup=0,
        models=(models.K3_TINY, models.GPT2, models.HF_GPT2, models.HF_KIMI),
        n_threads=1,
        out=buf,
    )
    text = buf.getvalue()
    assert "transformers is not installed: no transformers rows" in text
    assert list(report["models"]) == [models.K3_TINY, models.GPT2] and report["transformers"] is None
    assert report["kimi_linear_logits_check"] is None
    assert "transformers" not in text.split("| model |")[1].split("targets")[0]


def test_unknown_models_are_refused(capsys):
    with pytest.raises(ValueError, match="unknown models"):
        models.run(models=("gpt3",))
    assert main(["bench", "models", "--models", "gpt3"]) == 2
    assert "unknown models ['gpt3']" in capsys.readouterr().err
