"""The kernel switch (`k3.ops.kernels`): K3_KERNELS, set_kernels / use_kernels, and what "auto" picks.
fla's kernels themselves are checked in tests/kernels (make test-kernels)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import k3.ops as ops
from k3.ops import kernels


def test_auto_runs_k3s_own_forms_on_a_cpu(monkeypatch):
    monkeypatch.setattr(torch.ops.k3, "fla_chunk_delta", None)  # a call to fla would fail
    q = torch.randn(1, 5, 1, 4)
    with ops.use_kernels("auto"):
        assert not kernels.fla_runs("chunk_kda", q, lambda: None)
        o, _ = ops.chunk_kda(q, q, q, -torch.rand(1, 5, 1, 4), torch.rand(1, 5, 1))
    assert o.shape == (1, 5, 1, 4)


def test_set_kernels_returns_the_previous_choice_and_use_kernels_restores_it():
    before = ops.get_kernels()
    with ops.use_kernels("torch"):
        assert ops.get_kernels() == "torch"
        assert ops.set_kernels(None) == "torch" and ops.get_kernels() == "auto"
        ops.set_kernels("torch")
    assert ops.get_kernels() == before


@pytest.mark.parametrize("bad", ["cuda", "Triton", ""])
def test_a_bad_choice_names_the_argument_and_the_choices(bad):
    if bad == "":
        assert kernels._parse(bad, "x") == "auto"  # empty = unset
        return
    with pytest.raises(ValueError, match=r"set_kernels: `choice` must be one of auto, torch, fla.*" + bad):
        ops.set_kernels(bad)


def test_fla_without_fla_installed_says_what_to_install(monkeypatch):
    monkeypatch.setattr(kernels, "_FLA_INSTALLED", False)
    with pytest.raises(RuntimeError, match=r"pip install 'k3\[cuda\]'"):
        ops.set_kernels("fla")
    assert ops.get_kernels() != "fla"


def test_fla_on_cpu_tensors_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(kernels, "_FLA_INSTALLED", True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(kernels, "_choice", "fla")
    q = torch.randn(1, 5, 1, 4)
    with pytest.raises(RuntimeError, match="chunk_kda: .*TRITON_INTERPRET=1"):
        ops.chunk_kda(q, q, q, -torch.rand(1, 5, 1, 4), torch.rand(1, 5, 1))


def test_the_header_words_say_which_kernels_run(monkeypatch):
    monkeypatch.setattr(kernels, "_FLA_INSTALLED", True)
    with ops.use_kernels("auto"):
        assert kernels.kernels_words("cuda") == "delta-family kernels: fla's (Triton)"
        assert kernels.kernels_words("cpu") == "delta-family kernels: k3's PyTorch forms"
        monkeypatch.setattr(kernels, "_FLA_INSTALLED", False)
        assert "pip install 'k3[cuda]'" in kernels.kernels_words("cuda")
    with ops.use_kernels("torch"):
        assert kernels.kernels_words("cuda") == "delta-family kernels: k3's PyTorch forms"


def test_the_environment_variable_sets_the_choice_at_import():
    env = {**os.environ, "K3_KERNELS": "torch"}
    code = "import k3.ops; print(k3.ops.get_kernels())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "torch"
    env["K3_KERNELS"] = "gpu"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "K3_KERNELS must be one of auto, torch, fla" in bad.stderr


@pytest.mark.parametrize("value", ["gpu", "fla"])
def test_every_command_answers_a_bad_k3_kernels_in_one_line(value):
    """An unknown K3_KERNELS, or fla where fla is not installed, is one line from any command (even
    `k3 params`, which runs no op); importing k3 does not fail on it."""
    if value == "fla" and kernels.fla_installed():
        pytest.skip("fla is installed here")
    env = {**os.environ, "K3_KERNELS": value}
    assert subprocess.run([sys.executable, "-c", "import k3"], env=env, capture_output=True).returncode == 0
    out = subprocess.run([sys.executable, "-m", "k3", "params"], env=env, capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert (
        out.stderr.startswith("k3 params: error: the environment variable K3_KERNELS") and out.stderr.count("\n") == 1
    )
