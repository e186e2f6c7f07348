"""k3 lab inspect: a smoke run (a few training steps on a generated corpus) writes its claims, tables and
figures; each hook's recomputation equals what the layer computes; the summaries and verdicts follow
their definitions."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

import k3.lab
from k3.lab.inspect.checkpoint import finished, training_config
from k3.lab.inspect.recorder import router_loads
from k3.lab.inspect.stats import (
    HALF_LIFE_CAP,
    attn_res_verdict,
    balance_verdict,
    channel_verdict,
    half_life,
    imbalance,
    retrieval_scores,
    retrieval_verdict,
    within_head_spread,
)
from k3.layers import MoE


def test_smoke_run_writes_claims_tables_figures(tmp_path):
    result = k3.lab.run("inspect", "smoke", tmp_path / "docs")
    assert len(result.claims) == 4 and len(result.tables) == 4 and len(result.figures) == 4
    assert all(c.verdict != "not measurable here" for c in result.claims)  # kimi-k3-tiny has all four parts
    for fig in result.figures:
        assert (tmp_path / "docs" / fig.path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((tmp_path / "docs" / "lab" / "inspect.json").read_text())
    assert saved["setup"]["steps"] == 4 and saved["setup"]["train"]["preset"] == "kimi-k3-tiny"
    assert "k3 lab inspect --smoke" in (tmp_path / "docs" / "results.md").read_text()


def test_a_folder_that_is_no_checkpoint_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        k3.lab.run("inspect", "smoke", tmp_path / "docs", checkpoint=str(tmp_path))


def test_finished_needs_the_same_settings_and_the_last_step(tmp_path):
    cfg = training_config("smoke", tmp_path)
    out = tmp_path / "checkpoint"
    assert not finished(out, cfg)
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"")
    config = {"k3": {}, "train": dataclasses.asdict(cfg), "step": cfg.max_steps}
    (out / "config.json").write_text(json.dumps(config))
    assert finished(out, cfg)
    assert not finished(out, dataclasses.replace(cfg, max_steps=cfg.max_steps + 1))
    (out / "config.json").write_text(json.dumps({**config, "step": cfg.max_steps - 1}))
    assert not finished(out, cfg)


def test_router_loads_with_the_bias_are_the_routers():
    torch.manual_seed(0)
    moe = MoE(16, num_experts=8, top_k=2, expert_hidden=8, latent_dim=8)
    moe.gate.e_score_correction_bias.copy_(torch.linspace(-0.5, 0.5, 8))
    x = torch.randn(3, 10, 16)
    moe(x)
    with_bias, without = router_loads(moe, x)
    assert torch.equal(with_bias, moe.last_load) and with_bias.sum() == without.sum() == 60
    assert not torch.equal(with_bias, without)  # a bias this large changes the choice
    assert imbalance(torch.tensor([2, 2, 2, 2])) == 1.0
    assert imbalance(torch.tensor([4, 0, 0, 0])) == 4.0


def test_half_life_and_spread():
    hl = half_life(torch.tensor([-math.log(2), -math.log(2) / 10, 0.0]))
    assert hl[:2].tolist() == pytest.approx([1.0, 10.0]) and hl[2] == HALF_LIFE_CAP
    channels = torch.tensor([[1.0] * 5 + [100.0] * 5, [7.0] * 10])  # [H = 2, K = 10]
    spread = within_head_spread(channels)
    assert spread[0].item() == pytest.approx(100.0, rel=1e-6) and spread[1].item() == pytest.approx(1.0)


def test_retrieval_scores_on_a_perfect_induction_head():
    period, T = 4, 8
    probs = torch.zeros(1, T, T)
    for i in range(T):  # attend to the token after the previous occurrence once there is one
        probs[0, i, i - period + 1 if i > period else i] = 1.0
    scores = retrieval_scores(probs, period)
    assert scores["induction"].item() == 1.0 and scores["copy"].item() == 0.0 and scores["previous"].item() == 0.0
    assert scores["uniform"].item() == pytest.approx(sum(1 / (i + 1) for i in range(period + 1, T)) / (T - period - 1))
    assert retrieval_verdict(1.0, 0.1) == "holds" and retrieval_verdict(0.2, 0.05) == "partly"
    assert retrieval_verdict(0.1, 0.05) == "does not hold"


def test_verdicts_follow_their_thresholds():
    assert attn_res_verdict([0.5, 0.6, 0.9]) == "holds"
    assert attn_res_verdict([0.7, 0.95, 0.99]) == "partly"
    assert attn_res_verdict([0.9, 1.0]) == "does not hold"
    assert balance_verdict([1.2, 1.3], [2.0, 2.0]) == "holds"
    assert balance_verdict([1.8, 2.0], [2.5, 2.5]) == "partly"
    assert balance_verdict([2.5], [2.0]) == "does not hold"
    assert channel_verdict([3.0, 2.5, 1.0]) == "holds"
    assert channel_verdict([1.5]) == "partly" and channel_verdict([1.0]) == "does not hold"
