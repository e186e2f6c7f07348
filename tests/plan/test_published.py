"""The planner against published figures (sources in k3.plan.published)."""

import pytest

from k3.plan.published import (
    check_deepseek_v3,
    check_kimi_k3_repository,
    check_nanogpt,
    check_torchtitan_deepseek_v3_16b,
)


def test_kimi_k3_repository_size_within_2_percent():
    f = check_kimi_k3_repository()
    assert abs(f["planner / published - 1"]) < 0.02


def test_deepseek_v3():
    f = check_deepseek_v3()
    assert f["parameters: planner"] == pytest.approx(671e9, rel=1e-3)
    assert f["active parameters: planner (embedding lookup excluded)"] == pytest.approx(37e9, rel=0.02)
    # the published GPU-hours imply an MFU near the planner's default 0.40 (bf16 peak), half that on fp8
    assert 0.3 < f["implied MFU on the H800's dense bf16 peak"] < 0.5
    planned = f["GPU-hours for 14.8T tokens: planner at MFU 0.4 (bf16 peak), compute alone"]
    assert planned == pytest.approx(2.664e6, rel=0.1)
    # k3's own layout at that scale (FSDP over all 2,048 GPUs, no pipeline) waits on the network
    assert f["GPU-hours for 14.8T tokens: planner, compute + exposed communication"] > 2 * planned


def test_torchtitan_deepseek_v3_16b():
    """One node: FSDP's traffic hides under the compute; the published tokens/s imply about its 20% MFU."""
    f = check_torchtitan_deepseek_v3_16b()
    assert f["step: exposed communication (planner)"] < 0.01 * f["step: compute at MFU 0.4 (planner)"]
    assert f["MFU the published tokens/s imply (planner's FLOPs)"] == pytest.approx(0.20, abs=0.03)
    assert f["tokens/s per GPU: planner"] == pytest.approx(2 * f["tokens/s per GPU: published (about)"], rel=0.15)


def test_nanogpt_gpt2():
    f = check_nanogpt()
    assert f["tokens (600,000 x 491,520)"] == 294_912_000_000
    assert 0.2 < f["implied MFU on the A100's dense bf16 peak"] < 0.4
    assert f["time on 8 x A100 40GB: planner at MFU 0.4"] < f["time on 8 x A100 40GB: published (about 4 days)"]
