"""k3 lab parts: a smoke run writes its claims, tables and figures; the FLOP and source-count models
match hand counts and the model; the K3 block keeps K3's proportions and shares its weights between
AttnRes on and off; the overhead fit recovers a synthetic curve; verdicts follow their stated thresholds."""

from __future__ import annotations

import json

import pytest
import torch

import k3.lab
from k3.bench.timing import interleaved_best, thread_clock
from k3.lab.parts.attn_res import (
    attn_res_flops,
    attn_res_pair,
    attn_res_verdict,
    fit_overhead,
    k3_block_config,
    leave_one_out,
    mean_sources,
)
from k3.lab.parts.latent_moe import moe_flop_ratios, moe_flops
from k3.lab.parts.situ import best_fused, situ_ratios, situ_verdicts, time_activations, time_elementwise
from k3.models import get_config
from k3.models.decoder import attn_res_source_counts


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
    assert "k3 fused situ (eager)" in result.claims[1].measured  # smoke mode does not compile: k3's fused
    assert "torch.compile" not in result.claims[1].measured  # SiTU is the only fused one measured
    assert "extrapolat" in result.claims[3].measured and "7,168" in result.claims[3].measured
    assert set(saved["data"]["attn_res"]) == {"16", "24", "32", "40"}
    assert torch.get_num_threads() == threads  # timed on one thread, then the count is restored


def test_moe_flops_by_hand_at_k3_size():
    c = get_config("kimi-k3")
    lat = moe_flops(
        c.hidden_size,
        c.moe_intermediate_size,
        c.num_experts,
        c.num_experts_per_tok,
        c.moe_latent_size,
        c.num_shared_experts,
    )
    full = moe_flops(
        c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok, None, c.num_shared_experts
    )
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
    def ratios(unfused, fused=None, compiled=None):
        out = {("activation", "fwd", "unfused formula"): unfused}
        for variant, r in (("k3 fused", fused), ("torch.compile", compiled)):
            if r is not None:
                out[("activation", "fwd", variant)] = r
        return out

    assert situ_verdicts(ratios(3.0)) == ("holds", "not measurable here")
    assert situ_verdicts(ratios(5.0, fused=1.2)) == ("partly", "holds")
    assert situ_verdicts(ratios(5.0, fused=2.5, compiled=1.2)) == ("partly", "holds")  # the best fused one
    assert best_fused(ratios(5.0, fused=2.5, compiled=1.2)) == "torch.compile"
    assert situ_verdicts(ratios(1.1, fused=2.0)) == ("does not hold", "does not hold")
    assert situ_verdicts(ratios(5.0, compiled=2.5))[1] == "partly"
    assert situ_verdicts(ratios(1.8, fused=1.5))[1] == "partly"  # <= 1.5x, but more than half the unfused excess
    assert situ_verdicts(ratios(4.0, fused=1.5))[1] == "holds"
    # AttnRes: the fitted overhead at K3's width, every phase: holds <= 4%, partly <= 10%
    assert attn_res_verdict([0.02, 0.04]) == "holds"
    assert attn_res_verdict([0.02, 0.041]) == "partly"
    assert attn_res_verdict([0.02, 0.10]) == "partly"
    assert attn_res_verdict([0.30, 0.01]) == "does not hold"


def test_fit_overhead_recovers_a_synthetic_curve_and_extrapolates_it():
    a, b, c, p, q = 2e-3, 3e-6, 4e-9, 1e-3, 5e-7
    widths = [256, 512, 1024, 2048]
    off = [a + b * d + c * d * d for d in widths]
    on = [t + p + q * d for t, d in zip(off, widths)]
    fit = fit_overhead(widths, on, off)
    assert fit.off == pytest.approx((a, b, c), rel=1e-6) and fit.extra == pytest.approx((p, q), rel=1e-6)
    assert fit.overhead(7168) == pytest.approx((p + q * 7168) / (a + b * 7168 + c * 7168**2), rel=1e-6)
    # a term that would fit negative is left out (non-negative least squares): off = c d^2 exactly
    fit = fit_overhead([1, 2, 3, 4], [1.1, 4.1, 9.1, 16.1], [1.0, 4.0, 9.0, 16.0])
    assert fit.off == pytest.approx((0.0, 0.0, 1.0), abs=1e-9) and fit.extra == pytest.approx((0.1, 0.0), abs=1e-9)
    widths = [256, 512, 1024, 2048, 4096]
    off = [a + b * d + c * d * d for d in widths]
    exact = (p + q * 7168) / (a + b * 7168 + c * 7168**2)
    assert leave_one_out(widths, [t + p + q * d for t, d in zip(off, widths)], off, 7168) == pytest.approx(
        (exact, exact), rel=1e-6
    )  # every subset recovers an exact curve
    with pytest.raises(ValueError, match="needs three distinct widths"):
        fit_overhead([256, 256, 512], [1.0, 1.0, 2.0], [1.0, 1.0, 2.0])
    with pytest.raises(ValueError, match="one entry each"):
        fit_overhead([256, 512, 1024], [1.0, 2.0], [1.0, 2.0, 3.0])


def test_k3_block_keeps_k3s_proportions_and_shares_weights_between_attn_res_on_and_off():
    k3 = get_config("kimi-k3")
    block = k3_block_config(2048)
    assert block.num_layers == 4 and block.layer_types == ["kda", "kda", "kda", "mla"]
    assert block.mlp_types == ["moe"] * 4 and block.hidden_size == 2048
    f = 2048 / 7168
    for name in ("q_lora_rank", "kv_lora_rank", "moe_intermediate_size", "moe_latent_size"):
        assert abs(getattr(block, name) - f * getattr(k3, name)) <= 4, name  # rounded to a multiple of 8
    assert block.num_heads == block.linear_num_heads == round(96 * f)
    assert (block.linear_head_dim, block.qk_nope_head_dim, block.qk_rope_head_dim, block.v_head_dim) == (
        k3.linear_head_dim,
        k3.qk_nope_head_dim,
        k3.qk_rope_head_dim,
        k3.v_head_dim,
    )
    assert block.num_experts_per_tok == k3.num_experts_per_tok and block.ffn_activation == "situ"
    assert mean_sources(block) == pytest.approx(29 / 9) and mean_sources(k3) > mean_sources(block)
    with pytest.raises(ValueError, match="`width` must be an int >= 8, got 4"):
        k3_block_config(4)
    pair = attn_res_pair(k3_block_config(32, num_experts=16))
    on, off = (dict(pair[v].named_parameters()) for v in ("on", "off"))
    assert set(off) < set(on) and all("attn_res" in n or "mlp_res" in n or "final_res" in n for n in set(on) - set(off))
    assert all(off[n].data_ptr() == on[n].data_ptr() for n in off)  # the same tensors, not copies
    assert pair["off"].config.attn_res_block_size is None and not pair["off"].training
    ids = torch.randint(0, 512, (1, 5))
    with torch.no_grad():
        assert torch.isfinite(pair["off"](ids)).all() and torch.isfinite(pair["on"](ids)).all()


def test_interleaved_best_keeps_each_cases_fastest_round():
    calls = {"a": 0, "b": 0}

    def case(name):
        def run():
            calls[name] += 1

        return run

    best = interleaved_best(
        {"a": case("a"), "b": case("b")}, rounds=3, warmup="ahead", grad=True, clock=thread_clock
    )  # as k3 lab parts times
    assert calls == {"a": 4, "b": 4} and set(best) == {"a", "b"} and all(t >= 0 for t in best.values())
    ratios = situ_ratios(
        {
            ("activation", "situ formula", "fwd", "eager"): 3.0,
            ("activation", "situ fused", "fwd", "eager"): 1.8,
            ("activation", "situ formula", "fwd", "compiled"): 1.2,
            ("activation", "swiglu", "fwd", "eager"): 1.5,
            ("activation", "swiglu", "fwd", "compiled"): 1.0,
        }
    )
    assert ratios == pytest.approx(
        {
            ("activation", "fwd", "unfused formula"): 2.0,
            ("activation", "fwd", "k3 fused"): 1.2,
            ("activation", "fwd", "torch.compile"): 1.2,
        }
    )


def test_a_failing_compile_leaves_eager_figures_and_a_note(monkeypatch):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(torch, "compile", no_compiler)
    notes = []
    times = time_activations(8, 4, 8, rounds=1, compiled=True, notes=notes)
    assert {mode for *_, mode in times} == {"eager"} and len(times) == 12  # 3 activations, 2 parts, 2 passes
    assert len(notes) == 4 and all("no C++ compiler found" in n for n in notes)
    ratios = situ_ratios(times)
    assert {variant for *_, variant in ratios} == {"unfused formula", "k3 fused"}
    assert best_fused(ratios) == "k3 fused" and situ_verdicts(ratios)[1] != "not measurable here"
    assert set(time_elementwise(8, 4, rounds=1, compiled=True)) == {
        ("tanh", "eager"),
        ("sigmoid", "eager"),
        ("silu", "eager"),
    }
