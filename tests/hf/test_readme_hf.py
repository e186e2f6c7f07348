"""docs/transformers.md's two Python blocks run as printed and show what they claim: the one without
a trained checkpoint in this process, the one that loads `runs/demo-hf` in a fresh interpreter that
never imports k3 itself (transformers' remote code does), on a tiny export made here."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from k3.cli import main  # noqa: E402

from ..test_docs import ROOT, python_block  # noqa: E402
from .test_export import training_checkpoint  # noqa: E402

PAGE = ROOT / "docs" / "transformers.md"


def test_readme_hf_example_runs(capsys):
    code = python_block(PAGE, "K3ForCausalLM.from_k3")
    namespace: dict = {}
    exec(compile(code, str(PAGE), "exec"), namespace)  # noqa: S102 - our own docs
    assert capsys.readouterr().out.strip().endswith("True")
    assert namespace["out"].shape == (2, 28)


@pytest.mark.slow
def test_export_loading_block_runs_without_k3_imported(tmp_path):
    """The block after `k3 export runs/demo runs/demo-hf`, in a folder where that export exists (a tiny
    kimi-k3-tiny with its tokenizer), offline: both continuations start with the prompt."""
    code = python_block(PAGE, 'from_pretrained("runs/demo-hf", trust_remote_code=True)')
    training_checkpoint(tmp_path / "runs" / "demo", "kimi-k3-tiny", hidden_size=64, num_layers=2)
    assert main(["export", str(tmp_path / "runs" / "demo"), str(tmp_path / "runs" / "demo-hf")]) == 0
    guard = "import sys\nassert 'k3' not in sys.modules\n"  # the block imports transformers only
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "HF_HOME": str(tmp_path / "hf_home"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(
        [sys.executable, "-c", guard + code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("ROMEO:") >= 2, done.stdout  # both continuations print their prompt
