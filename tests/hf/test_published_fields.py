"""`k3 export --format kimi-k3 / kimi-linear` write every field the published config.json files have
(tests/fixtures/published_config_keys.json: the key names of moonshotai/Kimi-K3's and
moonshotai/Kimi-Linear-48B-A3B-Instruct's config.json), so llama.cpp's converter and transformers' and
vLLM's loaders read them. Left out on purpose, and only these: `auto_map` (the published remote-code files,
which an export does not ship) and, for Kimi K3, the vision side (`vision_config`, its placeholder tokens:
an export holds no vision tower) and Kimi Linear's `rope_scaling: null` (it says nothing, and transformers 5
warns of the field as deprecated on every load)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3.hf.export import export
from k3.models import CausalLM, get_config

PUBLISHED = json.loads((Path(__file__).parents[1] / "fixtures" / "published_config_keys.json").read_text())
NOT_WRITTEN = {"auto_map", "vision_config", "image_placeholder", "media_placeholder_token_id", "rope_scaling"}


def exported_config(tmp_path, preset: str, format: str) -> dict:
    CausalLM(get_config(preset)).save_pretrained(tmp_path / "ckpt")
    export(tmp_path / "ckpt", tmp_path / "out", format=format)
    return json.loads((tmp_path / "out" / "config.json").read_text())


def missing(published: list[str], written: dict) -> set[str]:
    return set(published) - NOT_WRITTEN - set(written)


def test_kimi_k3_export_has_every_published_field(tmp_path):
    config = exported_config(tmp_path, "kimi-k3-tiny", "kimi-k3")
    text = config["text_config"]
    assert not missing(PUBLISHED["kimi-k3"], config)
    assert not missing([k for k in PUBLISHED["kimi-k3.text_config"] if k != "quantization_config"], text)
    assert not missing(PUBLISHED["kimi-k3.text_config.linear_attn_config"], text["linear_attn_config"])
    # the four a converter needs that k3 did not write before, with the model's values
    assert text["dtype"] == config["dtype"] == "bfloat16"
    assert text["max_position_embeddings"] == 1_048_576 and text["use_grouped_topk"] is True
    assert text["head_dim"] == 192 // 4


@pytest.mark.parametrize("quantize", ["mxfp4"])
def test_quantized_kimi_k3_export_has_the_quantization_config(tmp_path, quantize):
    CausalLM(get_config("kimi-k3-tiny")).save_pretrained(tmp_path / "ckpt")
    export(tmp_path / "ckpt", tmp_path / "out", format="kimi-k3", quantize=quantize)
    text = json.loads((tmp_path / "out" / "config.json").read_text())["text_config"]
    assert not missing(PUBLISHED["kimi-k3.text_config"], text)


def test_kimi_linear_export_has_every_published_field(tmp_path):
    config = exported_config(tmp_path, "kimi-linear-tiny", "kimi-linear")
    assert not missing(PUBLISHED["kimi-linear"], config)
    assert not missing(PUBLISHED["kimi-linear.linear_attn_config"], config["linear_attn_config"])
    assert config["model_max_length"] == 1_048_576 and config["dtype"] == "float32"
