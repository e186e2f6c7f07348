"""Trust, second pass (loading): a checkpoint the model cannot compute with is refused in one line naming the
file, the tensor or the field, what was expected and what is there; `strict=False` loads it anyway.

Before: NaN, infinite, integer and bool weights loaded without a word (greedy `generate` then answered
token 0 forever); a config.json whose `vocab_size` contradicted the embedding was a bare list of shape
mismatches; a safetensors header claiming 2**62 bytes in a training checkpoint was safetensors' own
error naming no file; `k3 params --json --vs` dropped the second model and a tiny run exported in Kimi
K3's layout was called "kimi-k3".
"""

from __future__ import annotations

import json
import shutil
import struct
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3 import CausalLM, get_config
from k3.checkpoints.checkpoint import ConfigMismatch, load_into, read_config, unusable, values_flag
from k3.checkpoints.loading import check_weights
from k3.cli import main
from k3.hf.export import export

from .models.kimi_k3_files import write_published


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("checks") / "kimi-k3-tiny"
    torch.manual_seed(0)
    CausalLM(get_config("kimi-k3-tiny", vocab_size=257, hidden_size=32)).save_pretrained(path)
    return path


def variant(checkpoint: Path, out: Path, state=None, config=None) -> Path:
    """A copy of `checkpoint` with its tensors changed by `state(dict)` and its config.json by `config(dict)`."""
    shutil.copytree(checkpoint, out)
    if state is not None:
        tensors = load_file(out / "model.safetensors")
        state(tensors)
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        raw = json.loads((out / "config.json").read_text())
        config(raw)
        (out / "config.json").write_text(json.dumps(raw))
    return out


def one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message and "Traceback" not in message
    return message


# -- 1. values and dtypes ------------------------------------------------------------------------------
BAD_VALUES = [(float("nan"), "1 NaN"), (float("inf"), "1 infinite"), (-float("inf"), "1 infinite")]


@pytest.mark.parametrize(
    "bad, said", [(float("nan"), "1 NaN"), (float("inf"), "1 infinite"), (-float("inf"), "1 infinite")]
)
def test_a_weight_that_is_no_number_is_refused_by_name(checkpoint, tmp_path, bad, said):
    def spoil(t):
        t["model.layers.0.self_attn.q_proj.weight"][1, 2] = bad

    path = variant(checkpoint, tmp_path / "m", state=spoil)
    with pytest.raises(ValueError) as error:
        CausalLM.from_pretrained(path)
    assert (
        f"{path} holds weights no model can use: model.layers.0.self_attn.q_proj.weight (model.safetensors): "
        f"{said} among its 4,096 values, expected finite values. from_pretrained(..., strict=False)"
    ) in one_line(error)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
def test_an_integer_or_bool_weight_is_refused_from_the_header(checkpoint, tmp_path, dtype):
    def spoil(t):
        t["model.norm.weight"] = t["model.norm.weight"].to(dtype)

    path = variant(checkpoint, tmp_path / "m", state=spoil)
    expected = f"model.norm.weight (model.safetensors): expected floating-point values, got {str(dtype)[6:]}"
    with pytest.raises(ValueError) as error:
        CausalLM.from_pretrained(path)
    assert expected in one_line(error)
    config, native = read_config(path, CausalLM.config_class)
    with torch.device("meta"):
        model = CausalLM(config)
    with pytest.raises(ValueError, match=r"expected floating-point values"):  # before any memory is given
        check_weights(model, path, native)


def test_a_cast_that_overflows_is_refused(checkpoint, tmp_path):
    def spoil(t):
        t["model.norm.weight"][3] = 1e6  # finite in float32, beyond float16's 65504

    path = variant(checkpoint, tmp_path / "m", state=spoil)
    CausalLM.from_pretrained(path)  # float32: fine
    with pytest.raises(ValueError, match=r"model\.norm\.weight \(model\.safetensors\): 1 infinite among its 32"):
        CausalLM.from_pretrained(path, dtype=torch.float16)


def test_a_weight_of_another_shape_is_refused_even_unstrict(checkpoint, tmp_path):
    def spoil(t):
        t["model.norm.weight"] = t["model.norm.weight"][:31].clone()

    path = variant(checkpoint, tmp_path / "m", state=spoil)
    for strict in (True, False):
        with pytest.raises(ValueError) as error:
            CausalLM.from_pretrained(path, strict=strict)
        message = one_line(error)
        assert "shape mismatch model.norm.weight: checkpoint [31], model [32]" in message
        assert "config.json's" not in message  # no field makes norm.weight 31 and the rest 32 wide


def test_mxfp4_scales_that_are_no_number_are_refused(tmp_path):
    write_published(tmp_path / "src", shards=1)
    shard = tmp_path / "src" / "model-00001-of-00001.safetensors"
    tensors = load_file(shard)
    key = "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_scale"
    tensors[key][0, 0] = 255  # E8M0's NaN
    save_file(tensors, shard)
    with pytest.raises(ValueError, match=r"experts\.3\.w2\.weight_scale \(model-00001-of-00001\.safetensors\): 1 "):
        CausalLM.from_pretrained(tmp_path / "src", experts="mxfp4")  # kept as codes
    with pytest.raises(ValueError, match=r"experts\.3\.w2 \(model-00001-of-00001\.safetensors\): .* infinite among"):
        CausalLM.from_pretrained(tmp_path / "src")  # decoded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e5m2])
@pytest.mark.parametrize("n", [0, 1, 31, 4097])
def test_the_values_check_is_isfinite_all(dtype, n):
    """One min/max reduction per tensor says what `isfinite(t).all()` says, wherever the bad value sits."""
    t = torch.randn(n).to(dtype)
    assert not unusable({"w": values_flag("w", t)})
    for i in {0, n // 2, n - 1} if n else ():
        for bad in (float("nan"), float("inf"), -float("inf")):
            spoiled = t.clone()
            spoiled[i] = bad
            assert unusable({"w": values_flag("w", spoiled), "ok": values_flag("ok", t)}) == ["w"], (dtype, n, i)


def test_load_into_refuses_a_state_that_is_no_number():
    model = CausalLM(get_config("gpt2-tiny", vocab_size=64))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"][0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"checkpoint x holds weights no model can use: lm_head.weight: 1 NaN"):
        load_into(model, state, "checkpoint x")


# -- 2. config.json against the tensors -----------------------------------------------------------------
def test_a_vocab_size_that_contradicts_the_embedding_names_the_field(checkpoint, tmp_path):
    path = variant(checkpoint, tmp_path / "m", config=lambda c: c["k3"].update(vocab_size=300))
    with pytest.raises(ConfigMismatch) as error:
        CausalLM.from_pretrained(path)
    assert (
        "config.json's `vocab_size` is 300 but the tensors' is 257 (model.embed_tokens.weight is [257, 32], "
        "the config makes it [300, 32])"
    ) in one_line(error)
    assert error.value.fields == {"vocab_size": 257}


def test_a_kimi_config_names_its_own_spelling_of_the_field(checkpoint, tmp_path):
    export(checkpoint, tmp_path / "k3", format="kimi-k3")
    raw = json.loads((tmp_path / "k3" / "config.json").read_text())
    raw["text_config"]["num_attention_heads"] = 2  # the checkpoint's MLA layers have 4 heads
    (tmp_path / "k3" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigMismatch) as error:
        CausalLM.from_pretrained(tmp_path / "k3")
    assert "config.json's `num_attention_heads` is 2 but the tensors' is 4 (" in one_line(error)


# -- 3. strict=False --------------------------------------------------------------------------------
def test_strict_false_takes_the_tensors_sizes_with_a_warning(checkpoint, tmp_path):
    path = variant(checkpoint, tmp_path / "m", config=lambda c: c["k3"].update(vocab_size=300))
    with pytest.warns(UserWarning, match=r"`vocab_size` is 300 but the tensors' is 257.*loaded with the tensors"):
        model = CausalLM.from_pretrained(path, strict=False).eval()
    original = CausalLM.from_pretrained(checkpoint).eval()
    assert model.config == original.config
    ids = torch.randint(0, 257, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), original(ids))


def test_strict_false_loads_values_and_dtypes_with_a_warning(checkpoint, tmp_path):
    def spoil(t):
        t["model.norm.weight"] = torch.arange(32, dtype=torch.int32)
        t["lm_head.weight"][0, 0] = float("nan")

    path = variant(checkpoint, tmp_path / "m", state=spoil)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = CausalLM.from_pretrained(path, strict=False)
    said = [str(w.message) for w in caught]
    assert (
        len(said) == 1 and "model.norm.weight (model.safetensors): expected floating-point values, got int32" in said[0]
    )
    assert "lm_head.weight (model.safetensors): 1 NaN among" in said[0]
    assert model.model.norm.weight.dtype == torch.float32 and model.model.norm.weight[5] == 5
    assert model.lm_head.weight[0, 0].isnan()


# -- 4. safetensors files that are not ----------------------------------------------------------------
def claim_2_62_bytes(path: Path) -> None:
    path.write_bytes(struct.pack("<Q", 2**62) + path.read_bytes()[8:])


def offsets_to_2_62(path: Path) -> None:
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    header[next(k for k in header if k != "__metadata__")]["data_offsets"] = [0, 2**62]
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


@pytest.mark.parametrize("damage", [claim_2_62_bytes, offsets_to_2_62, lambda p: p.write_bytes(p.read_bytes()[:-64])])
@pytest.mark.parametrize("step", [None, 3])  # a training checkpoint's config.json records its step
def test_a_damaged_safetensors_file_is_named(checkpoint, tmp_path, damage, step):
    path = variant(checkpoint, tmp_path / "m", config=lambda c: c.update(step=step) if step else None)
    damage(path / "model.safetensors")
    with pytest.raises(ValueError) as error:
        CausalLM.from_pretrained(path)
    assert f"{path}: model.safetensors is damaged or not a safetensors file (truncated, or another format: " in (
        one_line(error)
    )


def test_a_damaged_shard_of_several_is_named(tmp_path):
    write_published(tmp_path / "src")
    claim_2_62_bytes(tmp_path / "src" / "model-00002-of-00003.safetensors")
    with pytest.raises(ValueError, match=r"src: model-00002-of-00003\.safetensors is damaged or not a safetensors"):
        CausalLM.from_pretrained(tmp_path / "src")


# -- 5. k3 params --------------------------------------------------------------------------------------
def test_params_json_vs_gives_both_models(capsys):
    assert main(["params", "kimi-k3-tiny", "--json", "--vs", "gpt2-tiny"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["name"] == "kimi-k3-tiny" and out["vs"]["name"] == out["vs"]["preset"] == "gpt2-tiny"
    assert out["vs"]["total"] > 0 and out["ratio"] == out["total"] / out["vs"]["total"]
    assert set(out["vs"]) == set(out) - {"vs", "ratio"}


def test_params_names_an_exported_tiny_model_by_its_folder(checkpoint, tmp_path, capsys):
    export(checkpoint, tmp_path / "tiny-export", format="kimi-k3")
    for source in (tmp_path / "tiny-export", tmp_path / "tiny-export" / "config.json"):
        assert main(["params", str(source)]) == 0
        first = capsys.readouterr().out.splitlines()[0]
        assert first.startswith("tiny-export (kimi-k3 architecture, not the kimi-k3 preset): 5 layers"), first
    assert main(["params", str(checkpoint), "--json"]) == 0  # a k3 checkpoint: the preset its run recorded
    assert json.loads(capsys.readouterr().out)["name"] == "kimi-k3-tiny"
    published = Path(__file__).parent / "fixtures" / "kimi_k3"  # the published config.json: the preset itself
    assert main(["params", str(published), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == "kimi-k3"
