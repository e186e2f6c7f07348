"""`k3 lab prefill`: the smoke run, and the cost models it compares against the clock."""

from __future__ import annotations

import json
import math

import pytest
import torch

import k3.lab
from k3.bench.ops import kda_inputs
from k3.lab import prefill
from k3.lab.prefill.fits import error_factor, fit_scale, loglog_slope
from k3.lab.prefill.ledger import OpLedger
from k3.lab.report import VERDICTS
from k3.ops import chunk_kda, chunk_linear_attn
from k3.ops.cost import article_cost, k3_cost
from k3.ops.numerics import halving_bound


def test_smoke_run_writes_claims_tables_figures(tmp_path):
    result = k3.lab.run("prefill", "smoke", tmp_path)
    assert len(result.claims) == 5 and all(c.verdict in VERDICTS for c in result.claims)
    assert len(result.tables) == 4 and all(t.rows for t in result.tables)
    for fig in result.figures:
        assert (tmp_path / fig.path).stat().st_size > 1000
    saved = json.loads((tmp_path / "lab" / "prefill.json").read_text())
    assert saved["name"] == "prefill" and saved["mode"] == "smoke"
    text = (tmp_path / "results.md").read_text()
    assert "k3 lab prefill --smoke" in text and "2·L·d² + 2·L·C·d" in text
    assert "match it exactly" in text  # the dispatched matmuls equal k3_cost


def test_article_cost_is_the_formula():
    assert article_cost(T=100, d=8, C=16) == 2 * 100 * 64 + 2 * 100 * 16 * 8
    assert article_cost(T=10, d=8, C=64) == article_cost(T=10, d=8, C=10)  # one chunk: C = T


@pytest.mark.parametrize("op", ["linear_attn", "kda"])
@pytest.mark.parametrize("T, C", [(64, 16), (100, 32), (96, 96), (200, 48), (130, 64), (40, 64)])
def test_k3_cost_counts_every_matmul_the_op_runs(op, T, C):
    """k3_cost equals the multiply-adds of the matmuls and triangular solves the op dispatches,
    including padding (T not a multiple of C), sub-chunks (C = 48, 64, 96) and one chunk (C >= T). KDA
    without a stated bound halves its blocks by the gates' own smallest step on the CPU (`halving_bound`):
    the count with that bound."""
    H, d = 2, 8
    q, k, v, g, beta = kda_inputs(T, H, d)
    with torch.no_grad(), OpLedger() as ledger:
        if op == "linear_attn":
            chunk_linear_attn(q, k, v, chunk_size=C)
        else:
            chunk_kda(q, k, v, g, beta, chunk_size=C)
    bound = halving_bound(g, None) if op == "kda" else None
    assert ledger.macs == H * k3_cost(op, T, d, C, lower_bound=bound)
    assert sum(ledger.seconds[name] for name in ("bmm", "matmul")) > 0


@pytest.mark.parametrize("T, C", [(64, 16), (100, 32), (200, 48), (130, 64), (40, 64)])
@pytest.mark.parametrize("lower_bound", [-5.0, -20.0, -1.0])
def test_k3_cost_counts_the_bounded_kda_gate(T, C, lower_bound):
    """With a stated lower bound (Kimi K3's safe gate, -5) chunk_kda halves its sub-chunks less and runs
    its blocks whole (more multiply-adds in fewer, larger products): k3_cost with the same lower_bound
    equals what it dispatches, and differs from the unbounded count where the halving stops early."""
    H, d = 2, 8
    q, k, v, g, beta = kda_inputs(T, H, d)
    with torch.no_grad(), OpLedger() as ledger:
        chunk_kda(q, k, v, g.clamp(min=lower_bound), beta, chunk_size=C, lower_bound=lower_bound)
    assert ledger.macs == H * k3_cost("kda", T, d, C, lower_bound=lower_bound)
    if lower_bound == -5.0:  # blocks of 16 or more in float32: fewer halvings than the unbounded gate
        assert k3_cost("kda", T, d, C, lower_bound=lower_bound) != k3_cost("kda", T, d, C)


def test_kda_cost_is_cubic_in_one_chunk():
    """The UT inverse: at C = T the count grows ~T^3, the article's model only ~T^2."""
    d = 64
    growth = k3_cost("kda", 8192, d, 8192) / k3_cost("kda", 4096, d, 4096)
    assert 7.0 < growth < 8.0
    assert 3.5 < article_cost(8192, d, 8192) / article_cost(4096, d, 4096) < 4.0


def test_fit_scale_and_slope_recover_known_values():
    costs = [1.0, 2.0, 8.0]
    assert fit_scale(costs, [3e-9 * x for x in costs]) == pytest.approx(3e-9)
    assert loglog_slope([1, 2, 4, 8], [5 * x**2.5 for x in (1, 2, 4, 8)]) == pytest.approx(2.5)
    assert error_factor(2.0, 1.0) == error_factor(1.0, 2.0) == 2.0
    assert math.isclose(error_factor(3.0, 3.0), 1.0)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="`op` must be one of"):
        k3_cost("delta", 64, 8, 16)
    with pytest.raises(ValueError, match="`C` must be a positive int, got 0"):
        article_cost(64, 8, 0)
    with pytest.raises(ValueError, match="two or more"):
        loglog_slope([1.0], [1.0])
    with pytest.raises(ValueError, match="takes no options"):
        prefill.run("smoke", None, checkpoint="x")
