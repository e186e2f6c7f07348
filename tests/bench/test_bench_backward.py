"""`k3 bench backward` runs end to end on tiny shapes and reports every case it promises."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from k3.bench import backward
from k3.cli import main


def test_bench_backward_tiny_run(tmp_path):
    """Every op and shape gets forward, own and autograd timings (the JSON holds them all)."""
    out = tmp_path / "bench.json"
    buf = io.StringIO()
    backward.run(
        shapes=((2, 40), (1, 70)), memory_T=0, heads=2, dim=8, chunk_size=16, rounds=1, json_path=str(out), out=buf
    )
    text = buf.getvalue()
    assert "machine matmul" in text and text.count("autograd through the forward") == 6
    data = json.loads(out.read_text())
    assert set(data["time"]) == {f"{op}/B{B}/T{T}" for op in backward.OPS for B, T in ((2, 40), (1, 70))}
    for times in data["time"].values():
        assert set(times) == {"forward", "own", "autograd"} and min(times.values()) > 0


def test_own_and_autograd_cases_give_the_same_gradients():
    """The two backward cases the benchmark times compute the same gradients (to rounding)."""
    made = backward.inputs("kda", 1, 70, 2, 8)
    args = made["args"]
    grads = []
    for way in (contextlib.nullcontext(), backward.autograd_through_forward()):
        for x in args.values():
            x.grad = None
        with way:
            backward._run("kda", args, 16).backward(made["do"])
        grads.append({n: x.grad.clone() for n, x in args.items()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
def test_bench_backward_memory_in_fresh_interpreters(tmp_path, capsys):
    """The memory figures come from fresh interpreters, and the own backward's peak is the smaller."""
    out = tmp_path / "bench.json"
    rc = main(["bench", "backward", "--quick", "--json", str(out)])
    assert rc == 0
    assert "peak memory" in capsys.readouterr().out
    memory = json.loads(out.read_text())["memory"]["kda"]
    assert 0 < memory["own"] < memory["autograd"]
