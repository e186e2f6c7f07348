"""`k3 bench profile`: every part of every layer is timed (forward, backward), beside the LM head with the
loss, the optimizer and the whole step, and summed per kind of module. No timing is asserted."""

from __future__ import annotations

import json

import pytest
import torch

from k3.bench import profile as bench_profile
from k3.models import CausalLM, get_config
from k3.training import TrainConfig

from ..corpus import write_corpus


class _Tokens:
    """Random windows of token ids, as `prepare`'s data hands them out."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def batch(self, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randint(0, self.vocab_size, (batch_size, seq_len + 1), generator=generator)


@pytest.mark.parametrize("preset", ["kimi-k3-tiny", "gpt2-tiny"])
def test_every_part_is_timed_and_summed_by_kind(preset):
    torch.manual_seed(0)
    model = CausalLM(
        get_config(preset, vocab_size=64, hidden_size=32, num_layers=2)
        if preset == "gpt2-tiny"
        else get_config(preset, vocab_size=64)
    )
    cfg = TrainConfig(batch_size=2, seq_len=32, max_steps=None, eval_every=10**9)
    result = bench_profile.profile_step(model, cfg, _Tokens(64), rounds=1)
    named = bench_profile.parts(model)
    assert set(result["parts"]) == set(named) and len(named) > len(model.model.layers)
    for name, part in result["parts"].items():
        assert part["kind"] == type(named[name]).__name__
        assert part["forward"] > 0 and part["backward"] >= 0
    assert result["step"] > 0 and result["optimizer"] > 0 and result["head"]["forward"] > 0
    kinds = bench_profile.by_kind(result)
    assert sum(row["count"] for row in kinds.values()) == len(named)
    assert sum(row["forward"] for row in kinds.values()) == pytest.approx(
        sum(part["forward"] for part in result["parts"].values())
    )
    if preset == "kimi-k3-tiny":  # the hybrid's kinds, each as often as the model has it
        assert kinds["KimiDeltaAttention"]["count"] == sum(
            type(layer.self_attn).__name__ == "KimiDeltaAttention" for layer in model.model.layers
        )
        assert {"MoE", "MultiHeadLatentAttention", "BlockAttnRes", "RMSNorm"} <= set(kinds)


def test_profiling_trains_the_model_and_leaves_no_gradient():
    """The timed steps train the model (its weights move); no timed call leaves a gradient behind."""
    torch.manual_seed(0)
    model = CausalLM(get_config("kimi-k3-tiny", vocab_size=64))
    before = model.lm_head.weight.detach().clone()
    cfg = TrainConfig(batch_size=2, seq_len=32, max_steps=None, eval_every=10**9)
    bench_profile.profile_step(model, cfg, _Tokens(64), rounds=1)
    assert not torch.equal(model.lm_head.weight, before)
    assert all(p.grad is None for p in model.parameters())


def test_run_prints_and_writes_both_models(tmp_path, capsys):
    corpus = write_corpus(tmp_path, docs=6, words=2000)
    out = tmp_path / "profile.json"
    results = bench_profile.run(rounds=1, json_path=str(out), data=str(corpus))
    text = capsys.readouterr().out
    assert "GFLOP/s (1024^3 float32)" in text and "LM head + loss" in text and "optimizer step" in text
    assert set(results) == {"kimi-k3-tiny", "gpt2-tiny"}
    assert json.loads(out.read_text())["kimi-k3-tiny"]["step"] == results["kimi-k3-tiny"]["step"]
