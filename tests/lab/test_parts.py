"""k3 lab parts: a smoke run writes its claims, tables and figures; the FLOP and source-count models
match hand counts and the model; verdicts follow their stated thresholds."""

from __future__ import annotations

import json

import pytest
import torch

import k3.lab
from k3.bench.timing import interleaved_best, thread_clock
from k3.lab.parts.attn_res import attn_res_flops, attn_res_verdict
from k3.lab.parts.latent_moe import moe_flop_ratios, moe_flops
from k3.lab.parts.situ import situ_ratios, situ_verdicts, time_activations, time_elementwise
from k3.models import get_config
from k3.models.model import attn_res_source_counts


def test_smoke_run_writes_claims_tables_figures(tmp_path):
    threads = torch.get_num_threads()
    result = k3.lab.run("parts", "smoke", tmp_path)
    assert len(result.claims) == 4 and len(result.tables) >= 4 and len(result.figures) == 3
    for fig in result.figures:
        assert (tmp_path / fig.path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((tmp_path / "lab" / "parts.json").read_text())
    assert saved["name"] == "parts" and saved["mode"] == "smoke"
    text = (tmp_path / "results.md").read_text()
    assert "k3 lab parts --smoke" in text and "latent MoE" in text
    assert result.claims[1].verdict == "not measurable here"  # smoke mode does not compile
    assert torch.get_num_threads() == threads  # timed on one thread, then the count is restored


def test_moe_flops_by_hand_at_k3_size():
    c = get_config("kimi-k3")
    lat = moe_flops(c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok,
                    c.moe_latent_size, c.num_shared_experts)
    full = moe_flops(c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok,
                     None, c.num_shared_experts)
    assert lat["routed experts"] == 16 * 3 * 2 * 3584 * 3072 == full["routed experts"] // 2
    assert lat["latent projections"] == 2 * 2 * 7168 * 3584 and full["latent projections"] == 0
    assert lat["shared experts"] == full["shared experts"] == 3 * 2 * 7168 * 2 * 3072
    assert lat["router"] == 2 * 7168 * 896
    ratios = moe_flop_ratios(7168, 3072, 896, 16, 3584, 2)
    assert ratios["routed experts"] == 0.5
    assert ratios["routed path"] == pytest.approx((16 * 6 * 3584 * 3072 + 4 * 7168 * 3584) / (16 * 6 * 7168 * 3072))
    assert 0.5 < ratios["routed path"] < ratios["MoE layer"] < 1
    with pytest.raises(ValueError, match="`top_k` must be >= 1, got 0"):
        moe_flops(64, 32, 8, 0)


def test_attn_res_flops_count_every_mix():
    k3_counts = attn_res_source_counts(get_config("kimi-k3"))
    assert attn_res_flops(get_config("kimi-k3")) == sum(6 * n * 7168 for n in k3_counts)
    assert attn_res_flops(get_config("kimi-k3", attn_res_block_size=None)) == 0


def test_verdicts_follow_their_thresholds():
    eager = {("activation", "fwd", "eager"): 3.0}
    assert situ_verdicts(eager) == ("holds", "not measurable here")
    assert situ_verdicts({("activation", "fwd", "eager"): 5.0,
                          ("activation", "fwd", "compiled"): 1.2}) == ("partly", "holds")
    assert situ_verdicts({("activation", "fwd", "eager"): 1.1,
                          ("activation", "fwd", "compiled"): 2.0}) == ("does not hold", "does not hold")
    assert situ_verdicts({("activation", "fwd", "eager"): 5.0,
                          ("activation", "fwd", "compiled"): 2.5})[1] == "partly"
    assert attn_res_verdict([0.02, 0.04]) == "holds"
    assert attn_res_verdict([0.02, 0.12]) == "partly"
    assert attn_res_verdict([0.30, 0.01]) == "does not hold"


def test_interleaved_best_keeps_each_cases_fastest_round():
    calls = {"a": 0, "b": 0}

    def case(name):
        def run():
            calls[name] += 1
        return run

    best = interleaved_best({"a": case("a"), "b": case("b")}, rounds=3, warmup="ahead", grad=True,
                            clock=thread_clock)  # as k3 lab parts times
    assert calls == {"a": 4, "b": 4} and set(best) == {"a", "b"} and all(t >= 0 for t in best.values())
    ratios = situ_ratios({("activation", "situ", "fwd", "eager"): 3.0,
                          ("activation", "swiglu", "fwd", "eager"): 1.5})
    assert ratios == {("activation", "fwd", "eager"): 2.0}


def test_a_failing_compile_leaves_eager_figures_and_a_note(monkeypatch):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(torch, "compile", no_compiler)
    notes = []
    times = time_activations(8, 4, 8, rounds=1, compiled=True, notes=notes)
    assert {mode for *_, mode in times} == {"eager"} and len(times) == 8
    assert len(notes) == 4 and all("no C++ compiler found" in n for n in notes)
    assert situ_verdicts(situ_ratios(times))[1] == "not measurable here"
    assert set(time_elementwise(8, 4, rounds=1, compiled=True)) == {("tanh", "eager"), ("sigmoid", "eager"),
                                                                    ("silu", "eager")}
