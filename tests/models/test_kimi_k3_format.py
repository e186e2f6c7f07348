"""Kimi K3's published checkpoint format in: its config.json gives the kimi-k3 preset (and the exact
parameter count), what k3 cannot compute is refused by name, and a tiny checkpoint written in the
published layout (tests/models/kimi_k3_files.py) loads with every value in place, dequantized or with
the experts kept in MXFP4, as a layer subset, or on the meta device."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from k3.checkpoints.hf_config import config_to_hf
from k3.layers.mxfp4_expert import MXFP4Expert
from k3.models import CausalLM, ModelConfig, get_config
from k3.models.params import config_for, count_params

from .kimi_k3_files import SATURATING, tiny_config, write_published

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "kimi_k3" / "config.json"
K3_PARAMS = 2_779_484_393_568


@pytest.fixture(scope="module")
def published():
    return json.loads(FIXTURE.read_text())


def test_published_config_is_the_kimi_k3_preset(published):
    config = ModelConfig.from_hf(published)
    assert config == get_config("kimi-k3")
    assert count_params(config).total == K3_PARAMS
    assert config_for(str(FIXTURE.parent)) == config  # `k3 params DIR`


def test_k3_params_reads_a_checkpoint_directory(capsys):
    from k3.cli import main

    assert main(["params", str(FIXTURE.parent)]) == 0
    from_dir = capsys.readouterr().out
    assert main(["params", "kimi-k3"]) == 0
    assert from_dir == capsys.readouterr().out and "2,779,484,393,568" in from_dir
    assert "routed experts MXFP4" in from_dir


def test_old_k3_names_still_read(published):
    text = copy.deepcopy(published["text_config"])
    lin = text["linear_attn_config"]
    del lin["gate_lower_bound"], lin["use_full_rank_gate"]
    text["linear_lower_bound"], text["use_full_rank_gate"] = -5, True
    text["moe_latent_size"] = text.pop("routed_expert_hidden_size")
    text["situ_beta"], text["situ_linear_beta"] = (
        text.pop("activation_situ_beta"),
        text.pop("activation_situ_linear_beta"),
    )
    assert ModelConfig.from_hf({**published, "text_config": text}) == get_config("kimi-k3")
    # ... but never written: k3 writes the published names
    written = config_to_hf(get_config("kimi-k3"))
    old = {"linear_lower_bound", "use_full_rank_gate", "moe_latent_size", "situ_beta", "situ_linear_beta"}
    assert not old & set(written)
    assert {k: written[k] for k in published["text_config"] if k in written} == {
        k: v for k, v in published["text_config"].items() if k in written
    }


def test_situ_defaults_follow_the_official_code(published):
    text = {k: v for k, v in published["text_config"].items() if not k.startswith("activation_situ")}
    config = ModelConfig.from_hf({"text_config": text})
    assert (config.situ_beta, config.situ_linear_beta) == (1.0, None)


def test_gate_lower_bound_and_renormalisation_are_read_and_written(published):
    """`gate_lower_bound` and `moe_renormalize` are fields of the model, not fixed at K3's values."""
    text = copy.deepcopy(published["text_config"])
    text["linear_attn_config"]["gate_lower_bound"] = -3.0
    text["moe_renormalize"] = False
    config = ModelConfig.from_hf({**published, "text_config": text})
    assert (config.kda_gate_lower_bound, config.moe_renormalize) == (-3.0, False)
    written = config_to_hf(config)
    assert written["linear_attn_config"]["gate_lower_bound"] == -3.0 and written["moe_renormalize"] is False


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_expert_group": 8, "topk_group": 4}, "group-limited routing"),
        ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
        ({"mla_use_nope": False}, "RoPE MLA"),
        ({"num_nextn_predict_layers": 1}, "num_nextn_predict_layers"),
        ({"latent_moe_use_norm": False}, "latent_moe_use_norm"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}, "quant_method.*'fp8'"),
        ({"quantization_config": "group_size"}, "group_size"),
    ],
)
def test_unsupported_fields_are_refused_by_name(published, change, message):
    text = copy.deepcopy(published["text_config"])
    if change.get("quantization_config") == "group_size":
        text["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 16
    else:
        text.update(change)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**published, "text_config": text})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kimi_k3_published")
    return directory, write_published(directory)


def load(directory, **kw):
    with pytest.warns(UserWarning, match="skipped 2 vision tensors"):
        return CausalLM.from_pretrained(directory, **kw).eval()


def test_every_tensor_lands_where_it_should(checkpoint):
    directory, truth = checkpoint
    model = load(directory)
    assert model.config == tiny_config().replace(name="kimi-k3")
    state = model.state_dict()
    assert set(state) == set(truth)
    for key, value in truth.items():
        assert torch.equal(state[key], value), key
    # A_log's padding (exp(30): every gate saturated) is not read
    a_log = state["model.layers.0.self_attn.A_log"]
    assert a_log.shape == (1, 1, 4, 1) and (a_log.abs() < SATURATING).all()


def test_prefill_then_decode_equals_the_full_forward(checkpoint):
    model = load(checkpoint[0])
    ids = torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(2)
        steps = [model(ids[:, :7], cache=cache)] + [model(ids[:, t : t + 1], cache=cache) for t in range(7, 11)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)


def test_experts_kept_in_mxfp4_give_the_same_logits_in_less_memory(checkpoint):
    directory, _ = checkpoint
    full, kept = load(directory), load(directory, experts="mxfp4")
    experts = [m for m in kept.modules() if isinstance(m, MXFP4Expert)]
    assert len(experts) == 4 * 16  # every routed expert of the 4 MoE layers
    ids = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(kept(ids), full(ids), rtol=1e-5, atol=1e-5)

    def routed_bytes(model):
        return sum(t.nbytes for k, t in model.state_dict().items() if ".experts." in k)

    weights = sum(t.numel() for k, t in full.state_dict().items() if ".experts." in k)
    assert routed_bytes(kept) * 8 == weights * 4.25  # 4.25 bits a weight
    assert routed_bytes(full) == weights * 4  # float32


def test_dtype_is_respected(checkpoint):
    model = load(checkpoint[0], dtype=torch.bfloat16, experts="mxfp4")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    expert = next(m for m in model.modules() if isinstance(m, MXFP4Expert))
    assert expert.w1.dtype == torch.bfloat16 and expert.w1_packed.dtype == torch.uint8


def test_a_subset_of_layers(checkpoint):
    directory, truth = checkpoint
    model = load(directory, layers=[3, 4])
    assert model.config.num_layers == 2 and model.config.layer_types == ["mla", "mla"]
    state = model.state_dict()
    for key, value in state.items():
        source = key.replace("model.layers.0.", "model.layers.3.").replace("model.layers.1.", "model.layers.4.")
        assert torch.equal(value, truth[source]), key
    with pytest.raises(ValueError, match="`layers` must be distinct layer indices in \\[0, 5\\)"):
        CausalLM.from_pretrained(directory, layers=[5])


def test_meta_device_builds_the_model_without_weights(published, tmp_path):
    # Kimi K3 at full width, cut to its first 4 layers (the whole model takes a minute to build on meta)
    text = {**published["text_config"], "num_hidden_layers": 4}
    text["linear_attn_config"] = {**text["linear_attn_config"], "kda_layers": [1, 2, 3], "full_attn_layers": [4]}
    (tmp_path / "config.json").write_text(json.dumps({**published, "text_config": text}))  # no weights: none read
    model = CausalLM.from_pretrained(tmp_path, device="meta", experts="mxfp4")
    assert model.lm_head.weight.is_meta and model.config == get_config("kimi-k3", num_layers=4, last_mla=False)
    expert = model.model.layers[1].block_sparse_moe.experts[0]
    assert isinstance(expert, MXFP4Expert) and expert.w1_packed.shape == (3072, 3584 // 2)
    plain = CausalLM.from_pretrained(tmp_path, device="meta")
    assert plain.num_parameters() == count_params(plain.config).total


def test_a_checkpoint_that_does_not_fit_is_refused(checkpoint, tmp_path):
    directory, _ = checkpoint
    for name in ("config.json", "model.safetensors.index.json"):
        shutil.copy(directory / name, tmp_path / name)
    for shard in directory.glob("*.safetensors"):
        shutil.copy(shard, tmp_path / shard.name)
    config = json.loads((tmp_path / "config.json").read_text())
    config["text_config"]["moe_intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="does not match the model's configuration: .*shape mismatch"):
        CausalLM.from_pretrained(tmp_path)  # refused from the headers, before any weight is allocated
