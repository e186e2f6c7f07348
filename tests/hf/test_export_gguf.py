"""`k3 export --format gguf` without llama.cpp (tests/gguf runs the files in it): the keys and tensors of
llama.cpp's architectures, read back with the gguf package; what llama.cpp cannot compute refused in one
line before anything is written; MXFP4 experts repacked to ggml's blocks without changing a value."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from k3.checkpoints.gguf_format import gguf_architecture, mxfp4_blocks
from k3.hf.export import export
from k3.models import CausalLM, get_config
from k3.ops import mxfp4
from k3.tokenizer import train_bpe
from tests.commands import fails


def exported(tmp_path, preset, outtype=None, tokenizer=None, **overrides):
    CausalLM(get_config(preset, **overrides)).save_pretrained(tmp_path / "run")
    if tokenizer is not None:
        tokenizer.save(tmp_path / "run" / "tokenizer.json")
    names = export(tmp_path / "run", tmp_path / "out", format="gguf", outtype=outtype)
    assert names == ["model.gguf"]
    return gguf.GGUFReader(tmp_path / "out" / "model.gguf")


def fields(reader) -> dict:
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("tokenizer.")}


def test_kimi_k3_keys_and_tensors(tmp_path):
    reader = exported(tmp_path, "kimi-k3-tiny")
    f, tensors = fields(reader), {t.name: t for t in reader.tensors}
    assert f["general.architecture"] == "kimi-k3"
    assert f["kimi-k3.attention.head_count_kv"] == [0, 0, 0, 1, 1]  # MLA as MQA over the latent; 0: KDA
    assert f["kimi-k3.kda.gate_lower_bound"] == -5.0 and f["kimi-k3.attn_res.block_size"] == 2
    assert f["kimi-k3.expert_latent_length"] == 64 and f["kimi-k3.leading_dense_block_count"] == 1
    assert f["kimi-k3.activation.situ_beta"] == 4.0 and f["kimi-k3.activation.situ_linear_beta"] == 25.0
    assert f["kimi-k3.attention.key_length"] == 32 + 16 and f["kimi-k3.attention.value_length_mla"] == 32
    # numpy's shapes reversed: ggml's [in, out, ...]
    assert list(tensors["blk.3.attn_k_b.weight"].shape) == [32, 32, 4]  # [dn, r, H]
    assert list(tensors["blk.3.attn_v_b.weight"].shape) == [32, 32, 4]  # [r, dv, H]
    assert list(tensors["blk.1.ffn_gate_exps.weight"].shape) == [64, 64, 16]
    assert list(tensors["blk.0.ssm_conv1d_q.weight"].shape) == [4, 1, 128, 1]
    assert list(tensors["blk.0.ssm_a"].shape) == [4] and "blk.0.ssm_g.weight" in tensors
    assert {"output_res_score.weight", "blk.4.ffn_res_score.weight", "blk.4.ffn_routed_norm.weight"} <= set(tensors)


def test_ssm_a_and_res_scores_hold_what_llama_cpp_multiplies(tmp_path):
    model = CausalLM(get_config("kimi-k3-tiny"))
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path / "run")
    export(tmp_path / "run", tmp_path / "out", format="gguf")
    tensors = {t.name: np.array(t.data) for t in gguf.GGUFReader(tmp_path / "out" / "model.gguf").tensors}
    layer = model.model.layers[0]
    np.testing.assert_allclose(tensors["blk.0.ssm_a"], -torch.exp(layer.self_attn.A_log).flatten().detach())
    score = (layer.attn_res.norm.weight * layer.attn_res.proj.weight.flatten()).detach()
    np.testing.assert_allclose(tensors["blk.0.attn_res_score.weight"], score, rtol=1e-6)


def test_one_expert_a_token_keeps_its_bare_score(tmp_path):
    f = fields(exported(tmp_path, "kimi-k3-tiny", num_experts_per_tok=1))
    assert f["kimi-k3.expert_weights_norm"] is False and f["kimi-k3.expert_used_count"] == 1


@pytest.mark.parametrize("preset, arch", [("kimi-linear-tiny", "kimi-linear"), ("gpt2-tiny", "gpt2")])
def test_kimi_linear_and_gpt2_architectures(tmp_path, preset, arch):
    f = fields(exported(tmp_path, preset))
    assert f["general.architecture"] == arch and f[f"{arch}.block_count"] == get_config(preset).num_layers


@pytest.mark.parametrize("outtype, matrix", [("bf16", "BF16"), ("q8_0", "Q8_0")])
def test_outtype_quantizes_the_matrices_only(tmp_path, outtype, matrix):
    tensors = {t.name: t.tensor_type.name for t in exported(tmp_path, "kimi-k3-tiny", outtype).tensors}
    assert tensors["blk.0.attn_q.weight"] == matrix and tensors["token_embd.weight"] == matrix
    for name in ("blk.0.attn_norm.weight", "blk.0.ssm_a", "blk.0.ssm_conv1d_q.weight", "blk.1.ffn_gate_inp.weight"):
        assert tensors[name] == "F32", name


def test_the_tokenizer_goes_inside(tmp_path):
    tok = train_bpe(["the quick brown fox jumps over the lazy dog " * 40], vocab_size=300)
    reader = exported(tmp_path, "kimi-k3-tiny", tokenizer=tok, vocab_size=tok.vocab_size)
    f = {name: field.contents() for name, field in reader.fields.items()}
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == "gpt-2"
    assert len(f["tokenizer.ggml.tokens"]) == tok.vocab_size and f["tokenizer.ggml.eos_token_id"] == tok.eot_id
    assert f["tokenizer.ggml.add_bos_token"] is False and len(f["tokenizer.ggml.merges"]) > 0
    assert not (tmp_path / "out" / "tokenizer.json").exists()  # inside the GGUF file


def test_the_chat_template_goes_inside(tmp_path):
    CausalLM(get_config("kimi-k3-tiny")).save_pretrained(tmp_path / "run")
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    (tmp_path / "run" / "chat_template.jinja").write_text(template)
    export(tmp_path / "run", tmp_path / "out", format="gguf")
    reader = gguf.GGUFReader(tmp_path / "out" / "model.gguf")
    assert reader.fields["tokenizer.chat_template"].contents() == template


def test_mxfp4_blocks_hold_the_same_values():
    w = torch.randn(3, 8, 64)
    packed, scale = mxfp4.encode(w)
    blocks = mxfp4_blocks(packed, scale)
    got = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.MXFP4)
    np.testing.assert_array_equal(got, mxfp4.decode(packed, scale, torch.float32).numpy())


@pytest.mark.parametrize(
    "preset, overrides, named",
    [
        ("kimi-k3-tiny", dict(layer_types=["kda"] * 3), "at least one KDA and one MLA"),
        ("kimi-k3-tiny", dict(linear_num_heads=2), "different head counts"),
        ("kimi-k3-tiny", dict(mlp_types=["moe", "dense", "moe", "moe", "moe"]), "dense FFN layers after"),
        ("kimi-k3-tiny", dict(linear_output_gate="low_rank"), "full rank"),
        ("kimi-linear-tiny", dict(kda_gate="safe"), "kimi-linear"),
        ("kimi-linear-tiny", dict(moe_renormalize=False), "always renormalizes"),
        ("kimi-linear-tiny", dict(layer_types=["kda", "gated_deltanet"] * 4), "layer types ['gated_deltanet']"),
        ("deltanet-tiny", {}, "layer types"),
    ],
)
def test_what_llama_cpp_lacks_is_refused(preset, overrides, named):
    with pytest.raises(ValueError, match="cannot be written as GGUF") as e:
        gguf_architecture(get_config(preset, **overrides))
    assert named in str(e.value)


def test_cli_refuses_before_writing_and_checks_outtype(tmp_path, capsys):
    CausalLM(get_config("deltanet-tiny")).save_pretrained(tmp_path / "run")
    fails(capsys, ["export", str(tmp_path / "run"), str(tmp_path / "out"), "--format", "gguf"], "llama.cpp lacks")
    assert not (tmp_path / "out").exists()
    fails(capsys, ["export", str(tmp_path / "run"), str(tmp_path / "o2"), "--outtype", "q8_0"], "outtype")
