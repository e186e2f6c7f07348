"""The recall and overwrite experiments: smoke runs write their section and figure; the verdicts follow the
measurements (they are computed, never fixed)."""

import json
import math

import pytest
import torch

from k3 import lab
from k3.lab import overwrite, recall
from k3.lab.synthetic import MIXERS, Size, best_over_rates, hybrid_layers, mixer_config, recipe
from k3.lab.tasks import Vocab, mqar
from k3.models import CausalLM


def test_mixer_configs_differ_only_in_the_mixer():
    size = Size(width=32, layers=4, head_dim=8)
    configs = {m: mixer_config(m, 100, size) for m in MIXERS}
    assert configs["kda+mla"].layer_types == ["kda", "kda", "kda", "mla"]
    assert configs["softmax"].layer_types == ["mha"] * 4
    for c in configs.values():
        assert (c.hidden_size, c.num_layers, c.vocab_size, c.intermediate_size) == (32, 4, 100, 64)
    # attention mixers: one head as wide as the model; linear mixers: heads of head_dim (their state size)
    assert configs["softmax"].num_heads == 1 and configs["kda+mla"].qk_nope_head_dim == 32
    assert configs["kda"].linear_num_heads == 4 and configs["kda"].linear_head_dim == 8


def test_deep_mixers_are_kimi_s_cycle_and_kda_alone_at_four_layers():
    size = Size(width=32, layers=2, head_dim=8)
    assert mixer_config("3kda+mla", 100, size).layer_types == ["kda", "kda", "kda", "mla"]
    assert mixer_config("4kda", 100, size).layer_types == ["kda"] * 4
    assert mixer_config("kda+mla", 100, size).layer_types == ["kda", "mla"]
    deep, shallow = mixer_config("4kda", 100, size), mixer_config("kda", 100, size)
    assert (deep.linear_head_dim, deep.hidden_size, deep.kda_gate) == (shallow.linear_head_dim, 32, "safe")
    with pytest.raises(ValueError, match="mixer must be one of"):
        mixer_config("5kda", 100, size)


def test_hybrid_keeps_an_mla_layer_at_any_depth():
    assert hybrid_layers(2) == ["kda", "mla"] and hybrid_layers(1) == ["mla"]
    assert hybrid_layers(8) == ["kda", "kda", "kda", "mla"] * 2
    with pytest.raises(ValueError, match="attention_heads"):
        mixer_config("softmax", 100, Size(width=32, head_dim=8, attention_heads=3))


def test_schedule_warms_up_holds_then_decays_to_zero():
    """`train_on_task`'s rates: training's warm-up and WSD over steps + 1 steps, the last (at 0) not taken."""
    from k3.training import learning_rate

    steps = 100
    scales = [learning_rate(recipe(1.0, warmup=10), s, steps + 1) for s in range(steps)]
    assert scales[0] == pytest.approx(0.1) and scales[9] == 1.0
    assert all(x == 1.0 for x in scales[10:80]) and scales[80] == 1.0
    assert scales[90] == pytest.approx(0.5) and scales[-1] == pytest.approx(0.05)


def test_best_over_rates_keeps_each_cells_best():
    by_rate = {1e-3: {1: 0.9, 2: 0.1, 3: math.nan}, 3e-3: {1: 0.5, 2: 0.7, 3: 0.2}}
    best, rate = best_over_rates(by_rate)
    assert best == {1: 0.9, 2: 0.7, 3: 0.2} and rate == {1: 1e-3, 2: 3e-3, 3: 3e-3}


def test_mla_retrieval_reads_the_attention_on_the_bound_value():
    torch.manual_seed(0)
    model = CausalLM(mixer_config("kda+mla", Vocab(8, 8).size, Size(width=16, layers=2, head_dim=4))).eval()
    batch = mqar(4, 12, 3, Vocab(8, 8), generator=torch.Generator().manual_seed(0))
    out = recall.mla_retrieval(model, batch)
    assert len(out["value"]) == 1 and len(out["value"][0]) == 1  # one MLA layer, one head
    # one filler token, then queries at positions 7, 9, 11 of every row: uniform gives the mean of 1/8, 1/10, 1/12
    assert out["uniform"] == pytest.approx((1 / 8 + 1 / 10 + 1 / 12) / 3)
    # checked by hand against the full attention matrix
    x = {}
    hook = model.model.layers[1].self_attn.register_forward_pre_hook(lambda m, a: x.setdefault("x", a[0]))
    model(batch.inputs)
    hook.remove()
    probs = model.model.layers[1].self_attn.attention_probs(x["x"])[:, 0]
    expected = []
    for b in range(4):
        for t in (7, 9, 11):
            binding = int((batch.inputs[b, :6] == batch.inputs[b, t]).nonzero()[0])
            expected.append(probs[b, t, binding + 1].item())
    assert out["value"][0][0] == pytest.approx(sum(expected) / len(expected), rel=1e-5)


def test_retrieval_verdict_follows_the_attention():
    hybrid, alone = {2: 1.0, 16: 0.95}, {2: 1.0, 16: 0.3}

    def claim(value, uniform=0.02):
        head = {"value": [[0.01, value]], "key": [[0.0, 0.0]], "uniform": uniform}
        weak = {"value": [[0.9, 0.9]], "key": [[0.0, 0.0]], "uniform": uniform}
        return recall.judge_retrieval({2: weak, 16: head}, hybrid, alone)  # read where KDA alone fails: 16 pairs

    assert claim(0.8).verdict == "holds" and "MLA layer 0, head 1" in claim(0.8).measured
    assert "at 16 pairs" in claim(0.8).measured
    assert claim(0.1).verdict == "partly" and claim(0.03).verdict == "does not hold"
    assert claim(0.4, uniform=0.2).verdict == "does not hold"  # above 0.3, but not 3x what uniform attention gives


def test_recall_smoke(tmp_path):
    plan = recall.PLANS["smoke"]
    result = lab.run("recall", "smoke", tmp_path)
    assert (tmp_path / "figures" / "recall.png").stat().st_size > 1000
    assert (tmp_path / "figures" / "recall-curves.png").stat().st_size > 1000
    assert len(result.claims) == 5 and len(result.tables[0].rows) == len(plan.mixers) == len(MIXERS) + 2
    assert result.tables[1].header == ["mixer", "1e-3", "3e-3"]  # the swept rates
    saved = json.loads((tmp_path / "lab" / "recall.json").read_text())
    assert set(saved["data"]["accuracy"]["D=4"]) == set(plan.mixers)
    assert set(saved["data"]["sweep"]["D=4"]["kda"]) == {"1e-3", "3e-3"}
    run = saved["data"]["runs"]["D=4,3kda+mla,1e-3"]
    assert run["steps"] >= plan.plateau.min_steps and run["curve"][-1][0] == run["steps"]
    assert set(run["retrieval"]) == {str(p) for p in plan.pairs(4)}
    assert set(saved["data"]["runs"]["D=4,linear_attn,3e-3"]["filler"]) == {"pairs", "long", "no filler", "filler"}
    assert "## Associative recall" in (tmp_path / "results.md").read_text()


def test_recall_plans_reach_eight_times_the_key_dimension():
    for mode in ("quick", "full"):
        plan = recall.PLANS[mode]
        for d in plan.head_dims:
            assert max(plan.pairs(d)) >= 8 * d and plan.trained(d)[0] == 1
            assert max(plan.trained(d)) == max(plan.pairs(d))
            assert plan.vocab.num_keys >= max(plan.pairs(d))  # keys drawn without replacement
        assert {"3kda+mla", "4kda"} <= set(plan.mixers)
    assert len(recall.PLANS["full"].head_dims) == 2 and len(recall.PLANS["full"].lrs) >= 2
    assert recall.PLANS["full"].pairs(8) == (4, 8, 16, 32, 64)
    assert recall.PLANS["full"].trained(4) == (1, 2, 4, 8, 16, 32)


def test_state_floats_count_each_model_s_layers():
    size = Size(width=32, layers=2, head_dim=8)  # 4 heads of 8 x 8: 256 floats per layer
    assert recall.state_floats("kda", size) == "512"
    assert recall.state_floats("4kda", size) == "1,024"
    assert recall.state_floats("kda+mla", size) == "256 + latent cache 16·T"
    assert recall.state_floats("3kda+mla", size) == "768 + latent cache 16·T"
    assert recall.state_floats("softmax", size) == "KV cache: 128·T"


def test_overwrite_smoke(tmp_path):
    result = lab.run("overwrite", "smoke", tmp_path)
    assert (tmp_path / "figures" / "overwrite.png").exists()
    assert len(result.claims) == 3 and len(result.tables[0].header) == 6
    assert result.tables[1].header == ["mixer", "5e-4", "1e-3", "3e-3"]


def _scores(value):
    return {m: {p: value(m, p) for p in (1, 2, 4, 8, 12)} for m in MIXERS}


def test_recall_verdicts_follow_the_numbers():
    # linear attention collapses past D = 4; everyone else holds: every claim holds
    good = recall.judge(
        _scores(lambda m, p: 0.2 if m == "linear_attn" and p > 4 else (0.5 if m == "kda" and p > 4 else 1.0)), 4
    )
    assert [c.verdict for c in good] == ["holds"] * 4
    # nobody learned anything: nothing is measurable
    flat = recall.judge(_scores(lambda m, p: 0.03), 4)
    assert all(c.verdict == "not measurable here" for c in flat)
    # linear attention does as well as everyone: its claim does not hold
    same = recall.judge(_scores(lambda m, p: 1.0), 4)
    assert same[0].verdict == "does not hold"


def test_overwrite_verdicts_follow_the_numbers():
    labels = [label for _, _, label in overwrite.COLUMNS]
    base = {m: dict.fromkeys(labels, 0.9) for m in MIXERS}
    base["linear_attn"][labels[1]] = 0.3
    base["deltanet"][labels[3]] = 0.1
    verdicts = [c.verdict for c in overwrite.judge(base)]
    assert verdicts[:2] == ["holds", "holds"] and verdicts[2] == "does not hold"


def test_a_mixer_that_did_not_learn_makes_only_its_claims_unmeasurable():
    scores = _scores(lambda m, p: 0.03 if m in ("kda", "kda+mla") else (0.2 if m == "linear_attn" and p > 4 else 1.0))
    verdicts = [c.verdict for c in recall.judge(scores, 4)]
    assert verdicts == ["holds", "holds", "not measurable here", "holds"]


def test_lab_softmax_reads_through_a_causal_convolution():
    from k3.lab.synthetic import ConvAttention, build_model

    torch.manual_seed(0)
    config = mixer_config("softmax", 20, Size(width=16, layers=2, head_dim=4, max_len=12))
    model = build_model(config).eval()
    assert all(isinstance(layer.self_attn, ConvAttention) for layer in model.model.layers)
    ids = torch.randint(0, 20, (2, 12))
    later = ids.clone()
    later[:, 7:] = (later[:, 7:] + 1) % 20
    with torch.no_grad():
        a, b = model(ids), model(later)
    torch.testing.assert_close(a[:, :7], b[:, :7])  # causal: the future never leaks back
    assert (a[:, 7:] - b[:, 7:]).abs().max() > 1e-4
    with pytest.raises(ValueError, match="no decoding cache"):
        model(ids, cache=model.new_cache(2))


def test_lab_linear_attention_is_deltanet_with_the_additive_update():
    from k3.lab.mixers import AdditiveLinearAttention, additive_rule
    from k3.lab.synthetic import build_model
    from k3.ops.common import l2norm

    torch.manual_seed(0)
    B, T, H, D = 2, 11, 3, 5  # T not a multiple of the chunk, odd head size
    q, k, v = (torch.randn(B, T, H, D, dtype=torch.float64) for _ in range(3))
    o, _ = additive_rule(q, k, v, torch.rand(B, T, H, dtype=torch.float64), chunk_size=4)
    qn, kn = l2norm(q) * D**-0.5, l2norm(k)
    S = torch.zeros(B, H, D, D, dtype=torch.float64)
    for t in range(T):  # S_t = S_{t-1} + k_t^T v_t, o_t = q_t S_t: beta and any normaliser play no part
        S = S + kn[:, t, :, :, None] * v[:, t, :, None, :]
        torch.testing.assert_close(o[:, t], (qn[:, t, :, None, :] @ S).squeeze(-2))

    config = mixer_config("linear_attn", 20, Size(width=16, layers=2, head_dim=4, max_len=12))
    model = build_model(config)
    assert all(isinstance(layer.self_attn, AdditiveLinearAttention) for layer in model.model.layers)
    ids = torch.randint(0, 20, (2, 12))
    assert model(ids).shape == (2, 12, 20)
    with pytest.raises(ValueError, match="no decoding cache"):
        model(ids, cache=model.new_cache(2))


def test_ordering_verdict_follows_the_means():
    def means(soft, hybrid, family, linear):
        return {
            "softmax": soft,
            "kda+mla": hybrid,
            "deltanet": family,
            "gated_deltanet": family,
            "kda": family,
            "linear_attn": linear,
        }

    published = means(1.0, 0.9, 0.7, 0.3)
    assert recall.judge_ordering({64: published, 128: published}).verdict == "holds"
    # the hybrid behind the DeltaNet family at one width: 5 of 6 relations
    assert recall.judge_ordering({64: published, 128: means(1.0, 0.6, 0.7, 0.3)}).verdict == "partly"
    reversed_order = means(0.3, 0.5, 0.7, 0.9)
    assert recall.judge_ordering({64: reversed_order, 128: reversed_order}).verdict == "does not hold"
    table = recall.ordering_table({64: published, 128: reversed_order})
    assert table.rows[0][-3:] == [1, 6, 1] and table.rows[1][-3:] == [6, 1, 4]  # softmax, linear attention


def test_a_full_run_is_kept_beside_the_quick_one(tmp_path):
    from k3.lab.report import Result, load_results, save_result

    for mode in ("quick", "full"):
        save_result(Result(name="recall", title=f"recall {mode}", mode=mode, command="c"), tmp_path)
    assert sorted(p.name for p in (tmp_path / "lab").iterdir()) == ["recall-full.json", "recall.json"]
    assert [r.mode for r in load_results(tmp_path, ["recall"])] == ["quick", "full"]


def test_lab_kda_uses_k3s_safe_gate_and_decays_only_matrices(monkeypatch):
    from k3.lab.synthetic import train_on_task

    size = Size(width=16, layers=2, head_dim=4)
    assert mixer_config("kda", 40, size).kda_gate == "safe" and mixer_config("kda+mla", 40, size).kda_gate == "safe"
    vocab = Vocab(8, 8)
    seen = {}
    real = torch.optim.AdamW

    def spy(groups, **kw):
        seen["groups"] = groups
        return real(groups, **kw)

    monkeypatch.setattr(torch.optim, "AdamW", spy)
    model, _ = train_on_task(
        mixer_config("kda", vocab.size, size), lambda g: mqar(2, 8, 2, vocab, generator=g), steps=1
    )
    names = {id(p): n for n, p in model.named_parameters()}
    decayed, kept = ({names[id(p)] for p in g["params"]} for g in seen["groups"])
    assert seen["groups"][0]["weight_decay"] > 0 and seen["groups"][1]["weight_decay"] == 0
    assert any(n.endswith("A_log") for n in kept) and any(n.endswith("dt_bias") for n in kept)
    assert not any(n.endswith(("A_log", "dt_bias")) or "norm" in n for n in decayed)
    assert any(n.endswith("q_proj.weight") for n in decayed)


def test_lab_mla_reads_its_latents_through_a_causal_convolution():
    from k3.lab.synthetic import ConvLatentAttention, build_model

    torch.manual_seed(0)
    config = mixer_config("kda+mla", 20, Size(width=16, layers=2, head_dim=4))
    plain = CausalLM(config).model.layers[1].self_attn
    conv = ConvLatentAttention.like(plain, 4)
    conv.load_state_dict(plain.state_dict(), strict=False)
    x = torch.randn(2, 9, 16)
    with torch.no_grad():
        conv.latent_conv1d.weight.zero_()[..., -1] = 1.0  # the identity: the current latent only
        assert torch.allclose(conv(x), plain(x), atol=1e-6)
        conv.latent_conv1d.weight.zero_()[..., -2] = 1.0  # a shift by one: position t reads latent t - 1
        shifted = conv.attention_probs(x)
        assert not torch.allclose(shifted, plain.attention_probs(x), atol=1e-3)
    with pytest.raises(ValueError, match="no decoding cache"):
        conv(x, cache=object())
    model = build_model(config)
    assert isinstance(model.model.layers[1].self_attn, ConvLatentAttention)
    # retrieval counts the W latents that hold the bound value; uniform scales by W
    batch = mqar(4, 12, 3, Vocab(8, 8), generator=torch.Generator().manual_seed(0))
    model = build_model(mixer_config("kda+mla", Vocab(8, 8).size, Size(width=16, layers=2, head_dim=4))).eval()
    out = recall.mla_retrieval(model, batch)
    assert out["uniform"] == pytest.approx((4 / 8 + 4 / 10 + 4 / 12) / 3)
    layer = model.model.layers[1].self_attn
    x = {}
    hook = layer.register_forward_pre_hook(lambda m, a: x.setdefault("x", a[0]))
    model(batch.inputs)
    hook.remove()
    probs = layer.attention_probs(x["x"])[:, 0]
    expected = []
    for b in range(4):
        for t in (7, 9, 11):
            binding = int((batch.inputs[b, :6] == batch.inputs[b, t]).nonzero()[0])
            expected.append(probs[b, t, binding + 1 : binding + 5].sum().item())
    assert out["value"][0][0] == pytest.approx(sum(expected) / len(expected), rel=1e-5)


def test_gradients_reach_the_mla_layer_of_the_three_to_one_hybrid():
    """Kimi Linear's 3 KDA : 1 MLA cycle (4 layers) as the lab builds it: one MQAR loss's gradient reaches every
    parameter of the MLA layer (its conv included), finite and not zero, and so does the last KDA layer's. A
    hybrid whose MLA layer cannot learn would show as uniform attention in the recall section; this rules out
    the simplest cause (a detached or unused path)."""
    from k3.lab.synthetic import ConvLatentAttention, build_model, masked_loss

    torch.manual_seed(0)
    vocab = Vocab(16, 16)
    config = mixer_config("kda+mla", vocab.size, Size(width=16, layers=4, head_dim=4))
    assert config.layer_types == ["kda", "kda", "kda", "mla"]
    model = build_model(config)
    mla = model.model.layers[3].self_attn
    assert isinstance(mla, ConvLatentAttention)
    batch = mqar(4, 24, 6, vocab, generator=torch.Generator().manual_seed(1))
    masked_loss(model, batch).backward()
    for layer in (3, 2):
        for name, p in model.model.layers[layer].self_attn.named_parameters():
            assert p.grad is not None, f"layer {layer} {name}: no gradient"
            assert torch.isfinite(p.grad).all(), f"layer {layer} {name}: non-finite gradient"
            assert p.grad.abs().max() > 0, f"layer {layer} {name}: zero gradient"


def test_conv_attention_probs_are_what_its_forward_reads():
    from k3.lab.synthetic import ConvAttention

    torch.manual_seed(0)
    layer = ConvAttention(16, 2)
    x = torch.randn(2, 7, 16)
    probs = layer.attention_probs(x)
    assert probs.shape == (2, 2, 7, 7) and torch.allclose(probs.sum(-1), torch.ones(2, 2, 7))
    assert probs.triu(1).abs().max() == 0  # causal
    _, _, v = layer._qkv(x)
    o = torch.einsum("bhts,bshd->bthd", probs, v).reshape(2, 7, 16)
    torch.testing.assert_close(layer.c_proj(o), layer(x), atol=1e-5, rtol=1e-4)
    assert layer.window == 4


def test_probe_models_are_what_their_names_say():
    from k3.lab.synthetic import PROBE_MIXERS, build_model

    size, vocab = Size(width=16, layers=2, head_dim=4), Vocab(8, 8)
    configs = {m: mixer_config(m, vocab.size, size) for m in PROBE_MIXERS}
    assert configs["2mla"].layer_types == ["mla", "mla"]
    assert configs["3kda+mha"].layer_types == ["kda", "kda", "kda", "mha"]
    assert configs["3kda+mha"].max_position_embeddings is None  # NoPE, as MLA
    assert configs["mla+3kda"].layer_types == ["mla", "kda", "kda", "kda"]
    from k3.layers import LinearAttention

    elu = build_model(configs["elu_linear_attn"])
    assert all(type(layer.self_attn) is LinearAttention for layer in elu.model.layers)  # the article's form
    torch.manual_seed(0)
    zero = build_model(configs["3kda0+mla"])
    torch.manual_seed(0)
    plain = build_model(mixer_config("3kda+mla", vocab.size, size))
    for a, b in zip(zero.model.layers[:3], plain.model.layers[:3]):
        assert a.self_attn.o_proj.weight.abs().max() == 0 and b.self_attn.o_proj.weight.abs().max() > 0
    assert zero.model.layers[3].self_attn.o_proj.weight.abs().max() > 0  # the MLA layer keeps its own
    # at the start the KDA layers add nothing: the stream before MLA is the embedding plus the MLPs' outputs
    seen = {}
    zero.model.layers[3].register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0]))
    ids = mqar(2, 12, 3, vocab, generator=torch.Generator().manual_seed(0)).inputs
    zero(ids)
    stream = zero.model.embed_tokens(ids)
    for layer in zero.model.layers[:3]:
        stream = stream + layer.ffn(layer.post_attention_layernorm(stream))
    torch.testing.assert_close(seen["x"], stream)


def _probe_cell(best: float, accuracy: float = 0.5, uniform: float = 0.02) -> dict:
    head = {"value": [[best]], "key": [[0.0]], "uniform": uniform}
    return {"accuracy": {2: accuracy, 4: accuracy}, "retrieval": {2: head, 4: head}}


def test_the_mla_disagreement_names_the_probe_that_explains_it():
    from k3.lab.report import Claim

    plan = recall.PLANS["smoke"]
    claims = [Claim("MLA layers retrieve from the token context exactly", "...", "does not hold")]
    scores = _scores(lambda m, p: 0.5)

    def paragraph(zero, from_large, mha=0.02, frozen=0.02, frozen_answers=0.5):
        probes = {
            ("2mla", 0): _probe_cell(0.95, 1.0),
            ("3kda+mha", 0): _probe_cell(mha),
            ("mla+3kda", 0): _probe_cell(0.9),
            ("3kda0+mla", 0): _probe_cell(zero, 0.8),
            ("3kda+mla", 2): _probe_cell(from_large),
            ("frozen3kda+mla", 0): _probe_cell(frozen, frozen_answers),
            ("elu_linear_attn", 0): {"accuracy": {2: 0.4, 4: 0.2}},
        }
        (note,) = recall.disagreements(claims, scores, 4, plan, probes, {})
        return note

    start = paragraph(zero=0.7, from_large=0.02)
    assert "MLA alone 0.95 at 2 pairs, 0.95 at 4 (it answers 100% over the counts)" in start
    assert "o_proj zero at the start 0.70 at 2 pairs, 0.70 at 4" in start and "The cause is the start" in start
    assert "× the embeddings' norm" in start
    assert "The cause is the optimisation" in paragraph(zero=0.02, from_large=0.6)
    frozen = paragraph(zero=0.02, from_large=0.02, frozen=0.8)
    assert "frozen at their initial weights 0.80 at 2 pairs" in frozen and "never recruited" in frozen
    learns = paragraph(zero=0.02, from_large=0.02)  # frozen KDA: it answers 50% without retrieving
    assert "learns to answer 50% over the counts without its attention layer retrieving" in learns
    reads = paragraph(zero=0.02, from_large=0.02, frozen_answers=0.0)  # frozen KDA: nothing learned at all
    assert "what the attention layer reads" in reads and "learns nothing at all" in reads
    assert "not pinned down here" in paragraph(zero=0.7, from_large=0.02, mha=0.5)  # attention in MLA's place retrieves
    assert "not pinned down here" in paragraph(zero=0.02, from_large=0.02, mha=0.5)
    # a retrieval claim that holds needs no paragraph
    claims[0].verdict = "holds"
    assert recall.disagreements(claims, scores, 4, plan, {("2mla", 0): _probe_cell(0.9)}, {}) == []


def test_the_deltanet_disagreement_sets_the_article_s_linear_attention_beside():
    from k3.lab.report import Claim

    plan = recall.PLANS["smoke"]  # D = 4: pairs 2 and 4 at or below D; the scores add 8 and 12 past it
    claims = [Claim("The delta rule overwrites instead of piling up, so DeltaNet retrieves more", "...", "partly")]
    scores = _scores(lambda m, p: 0.9 if p <= 4 else (0.3 if m == "deltanet" else 0.25))
    plan = recall.Plan(head_dims=(4,), span=3, lrs=(1e-3,), plateau=plan.plateau)  # pairs 2, 4, 8 (12 unscored)
    elu = {("elu_linear_attn", 0): {"accuracy": {2: 0.4, 4: 0.2, 8: 0.05}}}
    filler = {
        "linear_attn": {"pairs": 4, "long": 48, "no filler": 0.9, "filler": 0.2},
        "deltanet": {"pairs": 4, "long": 48, "no filler": 0.95, "filler": 0.9},
    }
    note, _ = recall.disagreements(claims, scores, 4, plan, elu, filler)
    assert "DeltaNet answers 90% and linear attention 90%; past D 30% and 25%" in note
    assert "the article writes it" in note and "30% at or below D pairs, 5% past D" in note
    assert "DeltaNet 90% and linear attention 20% (without filler 95% and 90%)" in note


def test_the_filler_probe_is_reported_with_its_numbers():
    plan = recall.PLANS["smoke"]
    filler = {"linear_attn": {"pairs": 4, "long": 16, "no filler": 0.9, "filler": 0.3}}
    (note,) = recall.disagreements([], _scores(lambda m, p: 0.5), 4, plan, {}, filler)
    assert "linear attention 90% without filler, 30% with it" in note and "T = 16" in note
