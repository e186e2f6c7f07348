"""`k3 bench models --compile` runs end to end on tiny settings (the compile backend swapped for "aot_eager",
which builds no C++): every model, batch and context, the JSON figures and the issue's targets. The fresh
process compile timings run in the slow test of tests/test_generate_compile.py's kind, not here. No timing
is asserted."""

from __future__ import annotations

import json

import pytest
import torch

from k3.bench import compiled
from k3.cli import main
from k3.inference import decode_step


@pytest.fixture
def aot_eager(monkeypatch):
    original = decode_step.compile_step
    monkeypatch.setattr(
        decode_step, "compile_step", lambda fn, device, backend="inductor": original(fn, device, "aot_eager")
    )
    monkeypatch.setattr(compiled, "Settings", _no_compile_times(compiled.Settings))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _no_compile_times(settings):
    def make(**kw):
        return settings(**{**kw, "compile_times": False})

    return make


def test_cli_tiny_run_reports_every_case(aot_eager, tmp_path, capsys):
    out = tmp_path / "compiled.json"
    assert (
        main(
            [
                "bench",
                "models",
                "--compile",
                "--contexts",
                "8",
                "20",
                "--batch",
                "1",
                "2",
                "--steps",
                "2",
                "--threads",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "GFLOP/s (1024^3 float32 GEMM)" in text and "1 thread;" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| model")]
    assert len(rows) == 3 * 2  # three models, two batches
    assert all(line.count("x) |") + line.count("x)|") >= 1 for line in rows)
    report = json.loads(out.read_text())
    for name in compiled.NAMES:
        assert set(report["models"][name]["decode_s"]) == {
            f"{mode} @{c} x{b}" for mode in ("eager", "compiled") for c in (8, 20) for b in (1, 2)
        }
    assert [t["target"].split(" ")[0] for t in report["targets"]] == ["kimi-k3-tiny", "compiled", "compiled"]
    assert "targets (issue 30):" in text


def test_no_cxx_compiler_is_refused(monkeypatch):
    from k3 import runtime

    monkeypatch.setattr(runtime, "cxx_compiler", lambda: None)
    with pytest.raises(ValueError, match="bench models --compile: torch.compile builds C\\+\\+ kernels"):
        compiled.run(contexts=[8], batch=[1], steps=1)
