"""`k3 plan --train`'s step = compute + exposed communication (`k3.plan.communication`)."""

from __future__ import annotations

import pytest

from k3.models import get_config
from k3.plan.communication import (
    COMM_EFFICIENCY,
    all_to_all_seconds,
    exposed_communication,
    shared_expert_flops_per_token,
)
from k3.plan.hardware import get_gpu
from k3.plan.shapes import Layout
from k3.plan.training import TrainSettings, muon_step_bytes, plan_training

H200 = get_gpu("h200")
TRAFFIC = {"fsdp all-gather": 40e9, "fsdp reduce-scatter": 40e9, "muon exchange": 4e9, "all-to-all (uniform)": 20e9}


def test_a_group_within_a_node_uses_nvlink_and_across_nodes_the_network():
    config = get_config("kimi-k3")
    one_node = exposed_communication(config, TRAFFIC, Layout(8, 1, 8, 8), H200, 1.0, 1e9)
    nodes = exposed_communication(config, TRAFFIC, Layout(64, 1, 64, 8), H200, 1.0, 1e9)
    assert one_node["time: FSDP all-gather and reduce-scatter"] == pytest.approx(80e9 / (COMM_EFFICIENCY * 450e9))
    assert nodes["time: FSDP all-gather and reduce-scatter"] == pytest.approx(80e9 / (COMM_EFFICIENCY * 50e9))
    assert nodes["time: Muon exchange"] == nodes["exposed: Muon exchange"] == pytest.approx(4e9 / 40e9)


def test_compute_hides_fsdp_traffic_but_not_its_first_gather():
    config = get_config("kimi-k3")
    long = exposed_communication(config, TRAFFIC, Layout(8, 1, 8, 8), H200, 100.0, 1e9)
    short = exposed_communication(config, TRAFFIC, Layout(8, 1, 8, 8), H200, 0.01, 1e9)
    first = 40e9 / (config.num_layers + 1) / (COMM_EFFICIENCY * 450e9)
    assert long["exposed: FSDP all-gather and reduce-scatter"] == pytest.approx(first)
    assert short["exposed: FSDP all-gather and reduce-scatter"] == pytest.approx(
        short["time: FSDP all-gather and reduce-scatter"] - 0.01
    )


def test_all_to_alls_wider_than_a_node_send_the_rest_over_the_network():
    assert all_to_all_seconds(10e9, 1, H200) == 0
    assert all_to_all_seconds(10e9, 8, H200) == pytest.approx(10e9 / 360e9)
    # ep 64: 56 of the 63 other ranks are in other nodes
    assert all_to_all_seconds(10e9, 64, H200) == pytest.approx(10e9 * 56 / 63 / 40e9)


def test_the_shared_experts_hide_the_all_to_all():
    config = get_config("kimi-k3")
    assert shared_expert_flops_per_token(config) > 0
    per_token = shared_expert_flops_per_token(config) * 4  # the shared experts: a quarter of the compute
    hidden = exposed_communication(config, TRAFFIC, Layout(64, 1, 64, 64), H200, 100.0, per_token)
    assert hidden["exposed: MoE all-to-all"] == 0
    bare = exposed_communication(
        get_config("kimi-k3", num_shared_experts=0), TRAFFIC, Layout(64, 1, 64, 64), H200, 1.0, 1e9
    )
    assert bare["exposed: MoE all-to-all"] == bare["time: MoE all-to-all"] > 0


def test_the_plan_adds_exposed_communication_to_the_compute():
    plan = plan_training(get_config("kimi-k3"), TrainSettings(gpus=1024))
    compute, exposed = plan["step time: compute"], plan["communication exposed communication"]
    assert plan["step time"] == pytest.approx(compute + exposed) and exposed > 0
    assert plan["MFU with communication"] == pytest.approx(0.4 * compute / (compute + exposed))
    assert plan["memory: Muon step beyond the freed activations"] >= 0
    assert muon_step_bytes(1e9) == pytest.approx(8e9 + 10 * 2**25)
    adamw = plan_training(get_config("kimi-k3"), TrainSettings(gpus=1024, optimizer="adamw"))
    assert adamw["communication exposed: Muon exchange"] == 0
