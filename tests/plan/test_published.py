"""The planner against published figures (sources in k3.plan.published)."""

import pytest

from k3.plan.published import check_deepseek_v3, check_kimi_k3_repository, check_nanogpt


def test_kimi_k3_repository_size_within_2_percent():
    f = check_kimi_k3_repository()
    assert abs(f["planner / published - 1"]) < 0.02


def test_deepseek_v3():
    f = check_deepseek_v3()
    assert f["parameters: planner"] == pytest.approx(671e9, rel=1e-3)
    assert f["active parameters: planner (embedding lookup excluded)"] == pytest.approx(37e9, rel=0.02)
    # the published GPU-hours imply an MFU near the planner's default 0.40 (bf16 peak), half that on fp8
    assert 0.3 < f["implied MFU on the H800's dense bf16 peak"] < 0.5
    planned = f["GPU-hours for 14.8T tokens: planner at MFU 0.4 (bf16 peak)"]
    assert planned == pytest.approx(2.664e6, rel=0.1)


def test_nanogpt_gpt2():
    f = check_nanogpt()
    assert f["tokens (600,000 x 491,520)"] == 294_912_000_000
    assert 0.2 < f["implied MFU on the A100's dense bf16 peak"] < 0.4
    assert f["time on 8 x A100 40GB: planner at MFU 0.4"] < f["time on 8 x A100 40GB: published (about 4 days)"]
