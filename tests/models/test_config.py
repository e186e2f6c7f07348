"""ModelConfig validation, presets and reading Kimi config.json files."""

from __future__ import annotations

import pytest

from k3.checkpoints.hf_config import config_to_hf
from k3.models import PRESETS, ModelConfig, get_config

# The Hub's config.json for moonshotai/Kimi-Linear-48B-A3B-Instruct, as published (relevant fields).
KIMI_LINEAR_HUB = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "vocab_size": 163840,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_shared_experts": 1,
    "moe_intermediate_size": 1024,
    "routed_scaling_factor": 2.446,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_expert_group": 1,
    "topk_group": 1,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "head_dim": 128,
        "num_heads": 32,
        "short_conv_kernel_size": 4,
    },
}


def test_every_preset_builds_a_valid_config():
    for name in PRESETS:
        c = get_config(name)
        assert len(c.layer_types) == c.num_layers == len(c.mlp_types)


def test_kimi_layer_patterns():
    k3 = get_config("kimi-k3")
    mla = [i + 1 for i, t in enumerate(k3.layer_types) if t == "mla"]
    assert mla == list(range(4, 93, 4)) + [93] and k3.layer_types.count("kda") == 69
    assert k3.mlp_types[0] == "dense" and set(k3.mlp_types[1:]) == {"moe"}
    article = get_config("kimi-k3-article")
    assert article.layer_types == ["kda", "kda", "kda", "mla"] * 23
    kl = get_config("kimi-linear")
    assert [i + 1 for i, t in enumerate(kl.layer_types) if t == "mla"] == [4, 8, 12, 16, 20, 24, 27]
    assert get_config("kimi-k3", num_layers=9).layer_types == ["kda"] * 3 + ["mla"] + ["kda"] * 3 + ["mla", "mla"]


def test_from_hf_reads_the_hub_config_as_the_preset():
    c = ModelConfig.from_hf(KIMI_LINEAR_HUB)
    assert c.replace(name="kimi-linear") == get_config("kimi-linear")
    nested = ModelConfig.from_hf({"model_type": "kimi_k25", "text_config": KIMI_LINEAR_HUB})
    assert nested.layer_types == c.layer_types


def test_from_hf_reads_transformers_spelling():
    hf = {k: v for k, v in KIMI_LINEAR_HUB.items() if k != "linear_attn_config"}
    hf.update(
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_hidden_layers=4,
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        linear_head_dim=64,
        linear_num_heads=8,
    )
    c = ModelConfig.from_hf(hf)
    assert c.layer_types == ["kda", "kda", "kda", "mla"] and c.mlp_types == ["dense", "moe", "moe", "moe"]
    assert (c.linear_head_dim, c.linear_num_heads) == (64, 8)


@pytest.mark.parametrize("name", ["kimi-linear", "kimi-k3", "kimi-k3-tiny"])
def test_kimi_config_json_round_trip(name):
    c = get_config(name)
    assert ModelConfig.from_hf(config_to_hf(c)).replace(name=c.name) == c


def test_inconsistent_configs_are_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"`hidden_size` \(100\) must be divisible by `num_heads` \(12\)"):
        get_config("gpt2", hidden_size=100)
    with pytest.raises(ValueError, match=r"`num_experts_per_tok` \(9\) must be in \[1, num_experts = 8\]"):
        get_config("kimi-linear-tiny", num_experts_per_tok=9)
    with pytest.raises(ValueError, match="`layer_types` has 3 entries but `num_layers` is 4"):
        ModelConfig(num_layers=4, layer_types=["mha"] * 3, mlp_types=["dense"] * 4)
    with pytest.raises(ValueError, match="unknown layer type 'gru'.*choose from"):
        ModelConfig(num_layers=1, layer_types=["gru"], mlp_types=["dense"])
    with pytest.raises(
        ValueError, match="unknown preset 'kimi-k4'; did you mean 'kimi-k3'.*the presets are: gpt2, .*kimi-k3-tiny"
    ):
        get_config("kimi-k4")
    with pytest.raises(ValueError, match="kda_layers"):
        ModelConfig.from_hf({**KIMI_LINEAR_HUB, "linear_attn_config": {"kda_layers": [0], "full_attn_layers": []}})
    with pytest.raises(ValueError, match="group-limited routing"):
        ModelConfig.from_hf({**KIMI_LINEAR_HUB, "num_expert_group": 8, "topk_group": 4})
    with pytest.raises(ValueError, match="no \\['hidden_size'"):
        ModelConfig.from_hf({"num_hidden_layers": 2, "vocab_size": 10})
