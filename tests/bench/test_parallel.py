"""`k3 bench parallel`: the bytes 4 gloo processes of fsdp x ep 2 send in a step, counted at the dispatcher,
are k3 plan's model of them (`k3.plan.traffic`): FSDP's all-gathers and reduce-scatters and distributed
Muon's exchanges to the byte, the MoE all-to-alls within the uniform-routing estimate's neighbourhood and
under its bound."""

from __future__ import annotations

import pytest

from k3.bench import parallel
from k3.models import get_config
from k3.plan.traffic import muon_exchange_per_rank

pytestmark = pytest.mark.slow  # 4 spawned processes


def test_four_processes_send_what_the_planner_says():
    ranks = parallel.measure(4, 2, seq_len=32, recompute="full")
    plan = parallel.planned(4, 2, seq_len=32, recompute="full")
    muon = muon_exchange_per_rank(get_config("kimi-k3-tiny", vocab_size=257), 4, 2)
    for rank, planned_muon in zip(ranks, muon):
        for name in ("fsdp all-gather", "fsdp reduce-scatter"):
            assert rank["sent"][name] == pytest.approx(plan[name], rel=1e-12), name
        # distributed Muon: each rank's two all-to-alls to the byte, nothing gathered whole
        assert rank["sent"]["muon exchange"] == planned_muon and "muon all-gather (whole)" not in rank["sent"]
        assert rank["ns_flops"] < 0.3 * parallel.whole_ns_flops("kimi-k3-tiny", 2)
        assert 0.9 * plan["all-to-all (uniform)"] < rank["sent"]["all-to-all"] <= plan["all-to-all (bound)"]
        assert rank["sent"]["all-reduce"] < 1e4  # the loss, the expert loads, the clipping norm
    report = parallel.format_report(
        {
            "preset": "kimi-k3-tiny",
            "seq_len": 32,
            "batch_size": 8,
            "layouts": [
                {"processes": 4, "ep": 2, "recompute": "full", "ranks": ranks, "planned": plan, "ns_flops_whole": 1}
            ],
        }
    )
    assert "4 processes, ep 2, recompute full, fp32:" in report and "(plan " in report


def test_bf16_gathers_half_the_bytes_of_float32_as_planned():
    """`--precision bf16` (FSDP's MixedPrecisionPolicy): the weights gathered in bfloat16, half float32's
    bytes and the planner's figure to the byte; the gradients still reduced in float32; the second step's
    loss within bfloat16's tolerance of float32's."""
    fp32 = parallel.measure(2, 1, seq_len=16, batch_size=2)
    bf16 = parallel.measure(2, 1, seq_len=16, batch_size=2, precision="bf16")
    plan = parallel.planned(2, 1, seq_len=16, batch_size=2, precision="bf16")
    for full, half in zip(fp32, bf16):
        assert half["sent"]["fsdp all-gather"] == pytest.approx(full["sent"]["fsdp all-gather"] / 2, rel=1e-12)
        assert half["sent"]["fsdp all-gather"] == pytest.approx(plan["fsdp all-gather"], rel=1e-12)
        assert half["sent"]["fsdp reduce-scatter"] == pytest.approx(full["sent"]["fsdp reduce-scatter"], rel=1e-12)
        assert half["sent"]["fsdp reduce-scatter"] == pytest.approx(plan["fsdp reduce-scatter"], rel=1e-12)
        assert half["loss"] == pytest.approx(full["loss"], rel=2e-2) and half["loss"] != full["loss"]
