"""k3.plan.traffic: the bytes a rank sends in a step, by collective (checked against real processes in
tests/bench/test_parallel.py); here, how they scale with the layout and the settings."""

from __future__ import annotations

import pytest

from k3.models import get_config
from k3.plan.shapes import Param
from k3.plan.traffic import other_ranks_per_token, padded_shard, step_traffic
from k3.plan.training import TrainSettings, plan_training

CONFIG = get_config("kimi-k3-tiny", vocab_size=257)


def test_shards_are_padded_as_fsdp2_pads_them():
    assert padded_shard([Param((5, 3), "matrix"), Param((4,), "vector")], 2) == 3 * 3 + 2
    assert padded_shard([Param((), "vector")], 4) == 1


def test_traffic_follows_the_layout_and_the_settings():
    one = step_traffic(CONFIG, 1, 1, 256)
    assert all(v == 0 for v in one.values())  # one rank sends nothing
    plain = step_traffic(CONFIG, 4, 1, 256)
    assert plain["all-to-all (bound)"] == 0 and plain["muon exchange"] > 0
    assert step_traffic(CONFIG, 4, 1, 256, optimizer="adamw")["muon exchange"] == 0
    twice = step_traffic(CONFIG, 4, 2, 256, micro_batches=2)
    once = step_traffic(CONFIG, 4, 2, 256)
    for name in ("fsdp all-gather", "fsdp reduce-scatter", "all-to-all (uniform)"):
        assert twice[name] == pytest.approx(2 * once[name])
    assert twice["muon exchange"] == once["muon exchange"]  # once a step
    assert once["fsdp all-gather"] < plain["fsdp all-gather"]  # ep: a rank gathers only its own experts
    recomputed = step_traffic(CONFIG, 4, 2, 256, recompute="full")
    assert recomputed["all-to-all (uniform)"] > once["all-to-all (uniform)"]  # the forward's exchange again
    assert recomputed["fsdp all-gather"] == once["fsdp all-gather"]
    uniform, bound = other_ranks_per_token(CONFIG, 2)
    assert bound == 1 and 0 < uniform < 1
    with pytest.raises(ValueError, match=r"ep \(3\) must divide fsdp \(4\)"):
        step_traffic(CONFIG, 4, 3, 256)


def test_the_plan_reports_what_each_gpu_sends():
    plan = plan_training(get_config("kimi-k3"), TrainSettings(gpus=1024))
    sent = {name: plan[name] for name in plan.values if name.startswith("sent per GPU per step")}
    assert len(sent) == 6 and all(v > 1e9 for v in sent.values())
    # distributed Muon: each matrix's rows to its owner and back, not every matrix to every rank
    whole = sent["sent per GPU per step: muon all-gather (whole)"]
    assert sent["sent per GPU per step: muon exchange"] < 0.1 * whole
    assert sent["sent per GPU per step: all-to-all (uniform)"] <= sent["sent per GPU per step: all-to-all (bound)"]
