"""`k3 export --format kimi-k3 [--quantize mxfp4|bf16]`: Kimi K3's published layout out, and back in.

A checkpoint in the published layout (tests/models/kimi_k3_files.py) -> k3 -> export gives back the same
tensors, byte for byte: the same names, dtypes (F32 for KDA's A_log, dt_bias, short convolutions and
o_norm and the router's correction bias, U8 for the MXFP4 codes and scales, BF16 for the rest), shapes
and bytes, A_log's unused padding included; the same model config. The routed experts stay as the
checkpoint stores them unless `quantize` says otherwise; k3's own checkpoints export too."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors import safe_open

from k3.checkpoints.kimi_k3_format import pad_a_log, published_entries
from k3.hf.export import export
from k3.models import CausalLM, ModelConfig
from tests.models.kimi_k3_files import FLOAT32, write_published


def read_all(directory) -> dict[str, torch.Tensor]:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(directory / shard), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    assert set(out) == set(index["weight_map"])
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def quietly(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the skipped vision tensors
        return fn(*args, **kw)


@pytest.mark.parametrize("canonical, quantize", [(False, None), (True, None), (False, "mxfp4")])
def test_published_checkpoint_round_trips_byte_for_byte(tmp_path, canonical, quantize):
    src = tmp_path / "src"
    write_published(src, canonical=canonical)
    names = quietly(export, src, tmp_path / "out", format="kimi-k3", quantize=quantize, max_shard_bytes=200_000)
    out = tmp_path / "out"
    assert "model.safetensors.index.json" in names and sum(n.startswith("model-0") for n in names) > 1
    before, after = read_all(src), read_all(out)
    assert set(after) == {k for k in before if k.startswith("language_model.")}  # the vision side is not k3's
    changed = [key for key, t in after.items() if not same_bytes(t, before[key])]
    assert not changed, changed
    float32 = {k for k, t in after.items() if t.dtype == torch.float32}
    # per KDA layer (3) A_log, dt_bias, q/k/v_conv1d, o_norm; per MoE layer (4) the correction bias
    assert len(float32) == 3 * 6 + 4 and all(k.endswith(FLOAT32) for k in float32), sorted(float32)
    assert {t.dtype for t in after.values()} == {torch.float32, torch.bfloat16, torch.uint8}
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "kimi_k3" and config["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert config["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
    src_config = json.loads((src / "config.json").read_text())
    assert ModelConfig.from_hf(config) == ModelConfig.from_hf(src_config)


def test_a_log_padding_is_checked():
    t = torch.arange(4.0).reshape(1, 1, 4, 1)
    assert pad_a_log(t, 8).tolist() == [0, 1, 2, 3, 0, 0, 0, 0]
    assert pad_a_log(t, 8, torch.full((4,), 7.0)).tolist() == [0, 1, 2, 3, 7, 7, 7, 7]
    with pytest.raises(ValueError, match=r"`padding` must hold 4 entries .*got shape \[3\]"):
        pad_a_log(t, 8, torch.zeros(3))


def test_dequantized_model_reencodes_canonical_codes(tmp_path):
    # loaded with the experts decoded (float32), then encoded again on the way out: the same bytes
    write_published(tmp_path, canonical=True)
    model = quietly(CausalLM.from_pretrained, tmp_path)
    before = read_all(tmp_path)
    for entry in published_entries(model, quantize=True):
        if entry.name.endswith((".weight_packed", ".weight_scale")):
            assert same_bytes(entry.make(), before[entry.name]), entry.name


def test_bf16_export_decodes_the_experts(tmp_path):
    write_published(tmp_path / "src")
    quietly(export, tmp_path / "src", tmp_path / "out", format="kimi-k3", quantize="bf16")
    out, before = read_all(tmp_path / "out"), read_all(tmp_path / "src")
    for key, t in out.items():  # everything but the experts as it was
        if ".experts." not in key:
            assert same_bytes(t, before[key]), key
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config["text_config"]
    assert "auto_map" not in config and not list((tmp_path / "out").glob("*.py"))  # Kimi K3's own code loads it
    w1 = out["language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight"]
    assert w1.dtype == torch.bfloat16 and w1.shape == (64, 64)
    assert out["language_model.model.layers.0.self_attn.A_log"].dtype == torch.float32
    assert out["language_model.model.layers.1.self_attention_res_proj.weight"].shape == (1, 192)
    assert "language_model.model.layers.1.block_sparse_moe.routed_expert_norm.weight" in out
    ids = torch.randint(0, 512, (1, 7))
    with torch.no_grad():
        a = quietly(CausalLM.from_pretrained, tmp_path / "src").eval()(ids)
        b = CausalLM.from_pretrained(tmp_path / "out").eval()(ids)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    # and that bf16 export, read again, exports as bf16 by default (as stored), MXFP4 when asked
    quietly(export, tmp_path / "out", tmp_path / "again", format="kimi-k3")
    assert all(same_bytes(t, out[k]) for k, t in read_all(tmp_path / "again").items())
    assert set(read_all(tmp_path / "again")) == set(out)


def test_k3_checkpoint_exports_to_the_published_layout(tmp_path):
    torch.manual_seed(0)
    from k3.models import get_config

    model = CausalLM(get_config("kimi-k3-tiny", vocab_size=256)).eval()
    model.save_pretrained(tmp_path / "k3")
    export(tmp_path / "k3", tmp_path / "plain", format="kimi-k3")  # full-precision experts: bf16
    plain = read_all(tmp_path / "plain")
    assert plain["language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight"].dtype == torch.bfloat16
    assert plain["language_model.model.layers.0.self_attn.dt_bias"].dtype == torch.float32
    export(tmp_path / "k3", tmp_path / "out", format="kimi-k3", quantize="mxfp4")
    again = CausalLM.from_pretrained(tmp_path / "out").eval()
    assert again.config == model.config.replace(name="kimi-k3")
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():  # experts now MXFP4, the rest bf16: close, not equal
        rel = ((again(ids) - model(ids)).norm() / model(ids).norm()).item()
    assert rel < 0.05
    for format, quantize in (("kimi-linear", "mxfp4"), ("k3", "bf16"), ("kimi-k3", "fp8")):
        with pytest.raises(ValueError, match="`quantize` must be one of"):
            export(tmp_path / "k3", tmp_path / "bad", format=format, quantize=quantize)


def test_a_damaged_shard_is_named_before_anything_is_written(tmp_path):
    write_published(tmp_path / "src")
    (tmp_path / "src" / "model-00002-of-00003.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{bad")
    with pytest.raises(ValueError, match="model-00002-of-00003.safetensors is damaged or not a safetensors file"):
        export(tmp_path / "src", tmp_path / "out", format="kimi-k3")
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["src"]
