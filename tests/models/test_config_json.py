"""A config.json whose values have the wrong JSON type is refused in one line naming the file or the field
(before: `"k3": null` was a TypeError from deep inside ModelConfig.from_dict, and `"layer_types": "kda"`
was read as the three layer types 'k', 'd', 'a')."""

from __future__ import annotations

import json
import re

import pytest

from k3 import CausalLM
from k3.checkpoints.checkpoint import read_config
from k3.models import ModelConfig, get_config
from k3.models.params import config_for

from .test_config import KIMI_LINEAR_HUB


def write(folder, raw) -> str:
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    return str(folder)


def one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    "value, kind", [(None, "null"), ([1, 2], "a list"), ("kimi-k3-tiny", "a string"), (5, "a number")]
)
def test_k3_key_of_another_type_is_refused_naming_config_json(tmp_path, value, kind):
    folder = write(tmp_path / "c", {"k3": value, "step": 3})
    for read in (lambda: read_config(tmp_path / "c", ModelConfig), lambda: config_for(folder)):
        with pytest.raises(ValueError, match=r"config\.json: `k3` must be an object") as e:
            read()
        assert kind in one_line(e)
    with pytest.raises(ValueError, match=r"config\.json: `k3` must be an object"):
        CausalLM.from_pretrained(folder)


def test_top_level_of_another_type_is_refused(tmp_path):
    write(tmp_path / "c", [1, 2])
    with pytest.raises(ValueError, match=r"config\.json: expected a JSON object .* got a list"):
        read_config(tmp_path / "c", ModelConfig)
    with pytest.raises(ValueError, match="expected a dict of ModelConfig fields, got null"):
        ModelConfig.from_dict(None)


@pytest.mark.parametrize("value", ["kda", None, 5])
def test_layer_types_that_is_no_list_is_refused_naming_it(tmp_path, value):
    raw = get_config("kimi-k3-tiny").to_dict()
    raw["layer_types"] = value
    write(tmp_path / "c", {"k3": raw})
    with pytest.raises(ValueError, match="`layer_types` must be a list") as e:
        read_config(tmp_path / "c", ModelConfig)
    assert "entries but" not in one_line(e)  # the letters of "kda" are not counted as layers


def test_a_tuple_of_layer_types_is_still_a_list():
    config = get_config("kimi-k3-tiny")
    assert ModelConfig(**{**config.to_dict(), "layer_types": tuple(config.layer_types)}) == config


@pytest.mark.parametrize(
    "change, field",
    [
        ({"num_hidden_layers": "27"}, "num_hidden_layers"),
        ({"hidden_size": None}, "hidden_size"),
        ({"linear_attn_config": [1]}, "linear_attn_config"),
        ({"linear_attn_config": {"kda_layers": "1,2", "full_attn_layers": []}}, "linear_attn_config.kda_layers"),
        ({"linear_attn_config": {"kda_layers": ["1"], "full_attn_layers": []}}, "linear_attn_config.kda_layers"),
        ({"layer_types": "kda"}, "layer_types"),
        ({"layer_types": [["kda"]] * 27}, "layer_types"),
        ({"num_expert_group": "8"}, "num_expert_group"),
        ({"hidden_act": ["silu"]}, "hidden_act"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),
        ({"model_type": 5}, "model_type"),
        (
            {"linear_attn_config": {**KIMI_LINEAR_HUB["linear_attn_config"], "gate_lower_bound": "-5"}},
            "linear_attn_config.gate_lower_bound",
        ),
    ],
)
def test_kimi_fields_of_the_wrong_type_are_refused_naming_them(change, field):
    with pytest.raises(ValueError, match=f"ModelConfig.from_hf: .*`{re.escape(field)}`") as e:
        ModelConfig.from_hf({**KIMI_LINEAR_HUB, **change})
    one_line(e)


def test_kimi_config_with_nulls_for_optional_fields_still_reads():
    raw = {**KIMI_LINEAR_HUB, "model_type": None, "num_expert_group": None, "linear_attn_config": None}
    assert ModelConfig.from_hf(raw).num_layers == 27
