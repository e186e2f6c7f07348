"""`k3 bench llama`: k3 and llama.cpp on the same weights, every engine's figures present and positive; a
missing llama-cpp-python is one line naming what installs it."""

from __future__ import annotations

import os

import pytest

from k3.bench import llama as bench
from tests.commands import fails

pytestmark = pytest.mark.gguf
if not os.environ.get("K3_LLAMA_CPP_SOURCE"):
    pytest.importorskip("llama_cpp")


def test_bench_llama_times_every_engine(tmp_path):
    lines = []
    figures = bench.run(quick=True, models=["kimi-k3-tiny"], contexts=[16], steps=2, out=lines.append)
    row = figures["models"]["kimi-k3-tiny"]
    assert set(row["prefill"]) == {"k3 eager", "llama.cpp f32", "llama.cpp q8_0"}
    assert set(row["decode"][16]) == set(bench.ENGINES)
    assert all(v > 0 for v in [*row["prefill"].values(), *row["decode"][16].values()])
    assert figures["matmul_gflops"] > 0 and any("k3 / llama.cpp f32" in line for line in lines)


def test_bench_llama_refuses_an_unknown_model():
    with pytest.raises(ValueError, match="kimi-k3-100m"):
        bench.run(quick=True, models=["llama-7b"])


def test_without_llama_cpp_the_cli_says_what_installs_it(monkeypatch, capsys):
    def missing():
        raise ModuleNotFoundError("k3 bench llama needs llama-cpp-python", name="llama_cpp")

    monkeypatch.setattr(bench, "_require_llama", missing)
    fails(capsys, ["bench", "llama", "--quick"], "needs llama-cpp-python")
