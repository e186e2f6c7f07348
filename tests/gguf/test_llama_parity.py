"""k3 and llama.cpp, a second implementation k3 did not write, compute the same models.

`k3 export --format gguf` of kimi-k3-tiny, kimi-linear-tiny, a hybrid of other parts (the plain KDA decay
gate, plain MLA queries and no output gate, no latent MoE, SiTU without its linear clamp, AttnRes blocks of
3), kimi-k3-tiny routing one expert a token with its bare score, and gpt2-tiny, with trained-looking
weights: llama.cpp's logits for 64 tokens, in one prefill and token by token through its own cache, equal
k3's in float32 within 2e-4 of the largest logit, the top-1 token equal at every position. Where the two
differ, they differ in one operation each, named here and in docs/llama.md, and a second comparison, with
k3 in float64 computing that operation llama.cpp's way, is within 1e-4:

- KDA's q/k L2 normalization: llama.cpp divides by sqrt(sum(x^2) + rms_norm_eps) (1e-5), fla and Kimi's
  published code (and k3) by sqrt(sum(x^2) + 1e-6).
- GPT-2's GELU: llama.cpp's CPU backend reads it from a float16 table, fp16(gelu(fp16(x))).

And the other road: `k3 export --format kimi-k3 / kimi-linear`, converted by llama.cpp's own
convert_hf_to_gguf.py, gives the same logits; the tokenizer inside the GGUF tokenizes 200 strings to k3's
ids. `make test-gguf` runs these (llama-cpp-python built from its sdist, the sdist's converter)."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch

from k3.checkpoints.gguf_format import write_gguf
from k3.hf.export import export
from k3.models import CausalLM, get_config
from k3.tokenizer import train_bpe

from .llama import convert, load, prefill_logits, stepwise_logits
from .strings import sample_strings, training_text

pytestmark = pytest.mark.gguf
if not os.environ.get("K3_LLAMA_CPP_SOURCE"):  # make test-gguf installs llama-cpp-python and sets this
    pytest.importorskip("llama_cpp")

HYBRID = dict(
    layer_types=["kda", "mla", "kda", "kda", "mla", "kda"],
    q_lora_rank=None,
    mla_output_gate=False,
    kda_gate="kimi_linear",
    moe_latent_size=None,
    situ_linear_beta=None,
    attn_res_block_size=3,
)
MODELS = {
    "kimi-k3-tiny": ("kimi-k3-tiny", {}),
    "kimi-linear-tiny": ("kimi-linear-tiny", {}),
    "hybrid": ("kimi-k3-tiny", HYBRID),
    "kimi-k3-tiny, one expert a token": ("kimi-k3-tiny", dict(num_experts_per_tok=1, moe_renormalize=False)),
    "gpt2-tiny": ("gpt2-tiny", {}),
}
TOLERANCE = 2e-4
SCALE = 1.5
RES_QUERY = 0.1  # the AttnRes queries' spread: sharper depth softmaxes amplify float32 rounding in any implementation


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe([training_text()], vocab_size=1024)


def trained_looking(model: CausalLM, seed: int = 0) -> CausalLM:
    """Weights away from their initial values, as training leaves them: norms and AttnRes queries spread,
    decay rates from 1 to 16, gate biases, router correction biases, larger matrices."""
    g = torch.Generator().manual_seed(seed)

    def rand(t, scale, offset=0.0):
        return offset + scale * torch.randn(t.shape, generator=g, dtype=t.dtype)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(1 + 15 * torch.rand(p.shape, generator=g, dtype=p.dtype)))
            elif name.endswith(("norm.weight", "layernorm.weight")) and p.dim() == 1:
                p.copy_(rand(p, 0.2, 1.0))
            elif name.endswith(("dt_bias", "e_score_correction_bias", ".bias")):
                p.copy_(rand(p, 0.3 if name.endswith("dt_bias") else 0.05))
            elif name.endswith("proj.weight") and "_res" in name:  # AttnRes queries (zero at init)
                p.copy_(rand(p, RES_QUERY))
            elif p.dim() >= 2:
                p.mul_(SCALE)
    return model


def model_and_gguf(tmp_path, key, tokenizer=None, outtype="f32", seed=0):
    preset, overrides = MODELS[key]
    vocab = tokenizer.vocab_size if tokenizer else get_config(preset).vocab_size
    torch.manual_seed(seed)
    model = trained_looking(CausalLM(get_config(preset, vocab_size=vocab, **overrides)), seed).eval()
    path = tmp_path / f"{key}-{outtype}.gguf"
    write_gguf(model, path, outtype, tokenizer)
    return model, path


def k3_logits(model, ids, llama_way=False, dtype=torch.float32) -> np.ndarray:
    """k3's logits in `dtype`; `llama_way`: with the one operation llama.cpp computes otherwise done its way
    (KDA's q/k L2 norm with rms_norm_eps, GPT-2's GELU through float16)."""
    import torch.nn.functional as F

    import k3.ops.common as common

    model = copy.deepcopy(model).to(dtype) if dtype != torch.float32 else model
    with pytest.MonkeyPatch.context() as mp:
        if llama_way:
            eps, inverse_norm, gelu = model.config.norm_eps, common._inverse_norm, F.gelu
            mp.setattr(common, "_inverse_norm", lambda x, _: inverse_norm(x, eps))
            table = lambda x, approximate="none": gelu(x.half().to(x.dtype), approximate=approximate).half().to(x.dtype)  # noqa: E731
            mp.setattr(F, "gelu", table)
        with torch.no_grad():
            return model(torch.tensor([ids]))[0].double().numpy()


def relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def ids_for(model, n=64, seed=0) -> list[int]:
    return torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("key", list(MODELS))
def test_llama_cpp_computes_k3s_model(tmp_path, key):
    model, path = model_and_gguf(tmp_path, key)
    ids = ids_for(model)
    want = k3_logits(model, ids)
    exact = k3_logits(model, ids, llama_way=True, dtype=torch.float64)
    llm = load(path)
    for got in (prefill_logits(llm, ids), stepwise_logits(llm, ids)):
        assert (got.argmax(-1) == want.argmax(-1)).all()
        # GPT-2's float16 GELU table costs more than the KDA norm's epsilon: 5e-4 there
        assert relative(got, want) < (5e-4 if key == "gpt2-tiny" else TOLERANCE), relative(got, want)
        # what is left once that operation is done llama.cpp's way: float32 rounding
        assert relative(got, exact) < TOLERANCE / 2, relative(got, exact)


@pytest.mark.parametrize("outtype, tolerance", [("bf16", 3e-2), ("q8_0", 8e-2)])
def test_bf16_and_q8_0_files_stay_close(tmp_path, outtype, tolerance):
    """llama.cpp's bf16 and q8_0 products round the activations too (to bfloat16, to 8 bits), so a near-tied
    expert choice can go the other way at a position: the median position's error is what is bounded."""
    model, path = model_and_gguf(tmp_path, "kimi-k3-tiny", outtype=outtype)
    ids = ids_for(model)
    got, want = prefill_logits(load(path), ids), k3_logits(model, ids)
    per_position = np.abs(got - want).max(-1) / np.abs(want).max()
    assert np.median(per_position) < tolerance, np.median(per_position)
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.75


def test_mxfp4_experts_stay_mxfp4(tmp_path):
    import gguf

    model = trained_looking(CausalLM(get_config("kimi-k3-tiny"))).eval()
    model.save_pretrained(tmp_path / "run")
    export(tmp_path / "run", tmp_path / "mx", format="kimi-k3", quantize="mxfp4")
    export(tmp_path / "mx", tmp_path / "gguf", format="gguf")
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "gguf" / "model.gguf").tensors}
    assert tensors["blk.1.ffn_down_exps.weight"].tensor_type.name == "MXFP4"
    assert tensors["blk.1.ffn_routed_down.weight"].tensor_type.name == "F32"
    mx = CausalLM.from_pretrained(tmp_path / "mx", experts="mxfp4").eval().float()
    ids = ids_for(mx, 32)
    got, want = prefill_logits(load(tmp_path / "gguf" / "model.gguf"), ids), k3_logits(mx, ids)
    # the same MXFP4 codes; ggml's products quantize the activations to 8 bits, k3's do not
    assert relative(got, want) < 0.25


@pytest.mark.parametrize("key, format", [("kimi-k3-tiny", "kimi-k3"), ("kimi-linear-tiny", "kimi-linear")])
def test_llama_cpps_converter_reads_k3s_exports(tmp_path, tokenizer, key, format):
    preset, overrides = MODELS[key]
    model = trained_looking(CausalLM(get_config(preset, vocab_size=tokenizer.vocab_size, **overrides)))
    model.save_pretrained(tmp_path / "run")
    tokenizer.save(tmp_path / "run" / "tokenizer.json")
    export(tmp_path / "run", tmp_path / "out", format=format)
    gguf_file = convert(tmp_path / "out", tmp_path / "converted.gguf")
    exported = CausalLM.from_pretrained(tmp_path / "out").eval().float()  # Kimi K3's: bfloat16 weights
    ids = ids_for(exported)
    got, want = prefill_logits(load(gguf_file), ids), k3_logits(exported, ids)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert relative(got, want) < TOLERANCE, relative(got, want)


def test_the_gguf_tokenizer_is_k3s(tmp_path, tokenizer):
    _, path = model_and_gguf(tmp_path, "kimi-k3-tiny", tokenizer)
    llm = load(path)
    strings = sample_strings(200)
    differ = [s for s in strings if llm.tokenize(s.encode(), add_bos=False, special=False) != tokenizer.encode(s)]
    assert not differ, differ[:3]
    assert all(llm.detokenize(tokenizer.encode(s)).decode() == s for s in strings)
    assert llm.token_eos() == tokenizer.eot_id
