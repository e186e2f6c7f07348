"""`k3 bench gpu`: the device check's plan prints without a GPU, and every part runs at toy sizes on the
CPU (the parts that need CUDA, the CUDA tests and fla called directly, left out), with its report."""

from __future__ import annotations

from k3.bench import gpu
from k3.cli import main
from tests.commands import fails


def test_the_dry_run_says_what_one_gpu_would_run(capsys):
    assert main(["bench", "gpu", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "B=8 T=4,096 H=16 K=V=128" in out and "target <= 1.05x" in out
    assert "kimi-k3 at 1.11 B parameters" in out and "4,096, 32,768" in out


def test_every_part_runs_at_toy_sizes_on_the_cpu(tmp_path):
    report = gpu.run(gpu.TINY, "cpu", json_path=str(tmp_path / "gpu.json"), say=lambda *_: None)
    assert "tests" not in report  # CUDA only
    assert [(r["op"], r["pass"]) for r in report["ops"]] == [
        ("kda", "forward"),
        ("kda", "forward+backward"),
        ("gdn", "forward"),
        ("gdn", "forward+backward"),
    ]
    assert all(set(r["ms"]) == {"k3 (dispatch)", "k3 PyTorch form"} for r in report["ops"])
    assert report["train"]["tokens/s"] > 0 and "MFU" not in report["train"]  # no GPU peak on a CPU
    assert [(r["model"], r["context"]) for r in report["decode"]] == [
        (m, c) for m in ("kimi-k3", "kimi-linear") for c in gpu.TINY.contexts
    ]
    assert (tmp_path / "gpu.json").exists() and set(report["seconds"]) == {"ops", "train", "decode"}
    assert any("| kda | forward |" in line for line in gpu.table(report))


def test_a_subset_of_the_parts_runs_alone(tmp_path, capsys):
    assert (
        main(["bench", "gpu", "--tiny", "--device", "cpu", "--parts", "ops", "--json", str(tmp_path / "g.json")]) == 0
    )
    out = capsys.readouterr().out
    assert "2. ops" in out and "3. train" not in out and "| gdn | forward+backward |" in out


def test_a_failing_part_is_reported_and_the_others_run(monkeypatch):
    def broken(*args):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(gpu, "time_train", broken)
    report = gpu.run(gpu.TINY, "cpu", say=lambda *_: None, parts=("train", "decode"))
    assert report["errors"] == {"train": "RuntimeError: CUDA out of memory (simulated)"}
    assert "train" not in report and len(report["decode"]) == 4
    assert "train failed: RuntimeError: CUDA out of memory (simulated)" in gpu.table(report)


def test_the_full_sizes_need_a_gpu(capsys):
    fails(capsys, ["bench", "gpu", "--device", "cpu"], "--device cpu runs only with --tiny")


def test_without_a_gpu_it_says_so_in_one_line(capsys):
    import torch

    if torch.cuda.is_available():
        return
    fails(capsys, ["bench", "gpu"], "k3 bench gpu needs a CUDA GPU and this PyTorch sees none", "--dry-run")
