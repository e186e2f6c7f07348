"""A k3 model as a GGUF file, llama.cpp's format, in the metadata keys and tensor names of llama.cpp's own
architectures: `kimi-k3` (src/models/kimi-k3.cpp), `kimi-linear` (src/models/kimi-linear.cpp) and `gpt2`.
Written with the `gguf` package, llama.cpp's own writer.

Which architecture (`gguf_architecture`): a model with SiTU feed-forwards is `kimi-k3` (its KDA layers need
the full-rank output gate), one with SwiGLU, the low-rank KDA output gate and Kimi Linear's decay gate is
`kimi-linear`, a GPT-2 is `gpt2`; what llama.cpp cannot compute is refused in one line naming it (layer
kinds other than KDA and MLA, a stack without both, RoPE in MLA, dense layers after the first MoE layer,
KDA and MLA with different head counts: llama.cpp reads one `head_count` for both).

The tensors, from k3's (module names as `k3.models` has them; the numpy shape is written, ggml reverses it):

    token_embd, output_norm, output            embeddings, final norm, head (written even when tied)
    blk.N.attn_norm / ffn_norm                 the pre-mixer / pre-FFN RMSNorms
    blk.N.attn_{q,k,v}                         KDA's q/k/v projections
    blk.N.ssm_conv1d_{q,k,v}                   the short convolutions [C, 1, K] -> [1, C, 1, K]
    blk.N.ssm_f_a / ssm_f_b / ssm_dt.bias      the decay gate's low-rank projection and bias
    blk.N.ssm_a                                -exp(A_log): [H] for kimi-k3, [1, 1, H, 1] for kimi-linear
    blk.N.ssm_beta, ssm_norm, attn_output      beta's projection, the output RMSNorm, o_proj
    blk.N.ssm_g (kimi-k3) | ssm_g_{a,b}        the output gate: full rank | low rank
    blk.N.attn_q | attn_q_a, attn_q_a_norm, attn_q_b      MLA's query (plain or LoRA)
    blk.N.attn_kv_a_mqa, attn_kv_a_norm        the latent [c | k_pe] and its norm
    blk.N.attn_k_b [H, r, dn], attn_v_b [H, dv, r]        kv_b_proj split per head (k_b transposed), so
                                               llama.cpp attends over the latent cache, absorbed
    blk.N.attn_gate                            gated MLA's output gate
    blk.N.ffn_{gate,up,down}                   a dense FFN (SwiGLU / SiTU: w1, w3, w2)
    blk.N.ffn_gate_inp, exp_probs_b.bias       the router and its correction bias
    blk.N.ffn_{gate,up,down}_exps              the routed experts stacked [E, out, in]
    blk.N.ffn_{gate,up,down}_shexp             the shared experts (one FFN, their widths together)
    blk.N.ffn_routed_{down,norm,up}            the latent MoE's projections and norm
    blk.N.{attn,ffn}_res_score, output_res_score          Block AttnRes: a site's RMSNorm weight times
                                               its query vector, one [D] vector (llama.cpp scores
                                               RMSNorm(h) . (norm * proj))

`outtype` as llama.cpp's converter: "f32", "bf16" or "q8_0" for the matrices; one-dimensional tensors,
norms, the router, the short convolutions and position embeddings stay float32; a q8_0 matrix whose rows
are not a multiple of 32 falls back to float16. Routed experts an MXFP4 model holds go in ggml's MXFP4
blocks, the same codes (a lossless repack), whatever `outtype` says.
"""

from __future__ import annotations

import os
import re
from typing import Iterator

import numpy as np
import torch

from .hf_config import CONTEXT_LENGTH

OUTTYPES = ("f32", "bf16", "q8_0")  # the matrices' types, as llama.cpp's converter's --outtype names them
_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
_FLOAT32_TENSORS = re.compile(r"(ffn_gate_inp|position_embd|ssm_conv1d_[qkv])\.weight$")


def gguf_architecture(config) -> str:
    """The llama.cpp architecture that computes `config`'s model exactly; a ValueError naming what
    llama.cpp lacks for any other."""
    c = config
    if c.norm == "layernorm" and set(c.layer_types) == {"mha"} and c.ffn_activation == "gelu":
        return "gpt2"
    kinds = sorted(set(c.layer_types) - {"kda", "mla"})
    moe = [i for i, t in enumerate(c.mlp_types) if t == "moe"]
    k3 = c.ffn_activation == "situ"
    problems = [
        what
        for bad, what in (
            (kinds, f"layer types {kinds} (llama.cpp's Kimi architectures have KDA and MLA layers only)"),
            (
                not kinds and set(c.layer_types) != {"kda", "mla"},
                "a stack of one layer kind: llama.cpp's hybrid cache needs at least one KDA and one MLA layer",
            ),
            (c.norm != "rmsnorm", f"norm {c.norm!r} (RMSNorm only)"),
            (c.ffn_activation not in ("situ", "swiglu"), f"ffn_activation {c.ffn_activation!r}"),
            (c.rope_theta is not None, "RoPE in MLA (rope_theta): llama.cpp's Kimi MLA is NoPE"),
            (moe and moe != list(range(moe[0], c.num_layers)), "dense FFN layers after the first MoE layer"),
            (
                "kda" in c.layer_types and "mla" in c.layer_types and c.linear_num_heads != c.num_heads,
                f"KDA and MLA with different head counts ({c.linear_num_heads} and {c.num_heads}): "
                f"llama.cpp reads one head_count for both",
            ),
            (
                k3 and "kda" in c.layer_types and c.linear_output_gate != "full",
                f"a SiTU model (kimi-k3) whose KDA output gate is {c.linear_output_gate!r} (kimi-k3's is full rank)",
            ),
            (
                not k3
                and (
                    c.kda_gate != "kimi_linear"
                    or c.linear_output_gate != "low_rank"
                    or c.mla_output_gate
                    or c.moe_latent_size
                    or c.attn_res_block_size
                ),
                "a SwiGLU model (kimi-linear) with K3's parts (the safe KDA gate, the full-rank KDA output gate, "
                "gated MLA, a latent MoE or Block AttnRes): llama.cpp's kimi-linear has none of them",
            ),
            (moe and c.num_shared_experts < 1 and not k3, "MoE layers without a shared expert (kimi-linear)"),
            (
                moe and not k3 and not (c.moe_renormalize and c.num_experts_per_tok > 1),
                "expert weights left as bare scores (moe_renormalize off, or one expert a token): llama.cpp's "
                "kimi-linear always renormalizes them",
            ),
        )
        if bad
    ]
    if problems:
        raise ValueError(f"{c.name!r} cannot be written as GGUF: llama.cpp lacks " + "; ".join(problems))
    return "kimi-k3" if k3 else "kimi-linear"


def gguf_metadata(config, arch: str) -> dict[str, object]:
    """{key: value} of the architecture's hyperparameters, by llama.cpp's key names (`<arch>.…`); ints are
    written uint32, floats float32, bools bool, lists arrays."""
    c = config
    if arch == "gpt2":
        keys = {
            "context_length": c.max_position_embeddings,
            "embedding_length": c.hidden_size,
            "feed_forward_length": c.intermediate_size,
            "attention.head_count": c.num_heads,
            "vocab_size": c.vocab_size,
            "attention.layer_norm_epsilon": float(c.norm_eps),
        }
    else:
        first_moe = next((i for i, t in enumerate(c.mlp_types) if t == "moe"), c.num_layers)
        keys = {
            "context_length": c.max_position_embeddings or CONTEXT_LENGTH,
            "embedding_length": c.hidden_size,
            "feed_forward_length": c.intermediate_size,
            "attention.head_count": c.num_heads if "mla" in c.layer_types else c.linear_num_heads,
            # MLA is served as MQA over the latent: one KV head; 0 marks a KDA (recurrent) layer
            "attention.head_count_kv": [1 if t == "mla" else 0 for t in c.layer_types],
            "attention.layer_norm_rms_epsilon": float(c.norm_eps),
            "vocab_size": c.vocab_size,
            "expert_count": c.num_experts,
            "expert_used_count": c.num_experts_per_tok,
            "expert_group_used_count": 1,
            "expert_gating_func": _SIGMOID,
            # k3 renormalizes the top-k weights only when there are several (one expert keeps its bare score)
            "expert_weights_norm": bool(c.moe_renormalize and c.num_experts_per_tok > 1),
            "expert_weights_scale": float(c.routed_scaling_factor),
            "expert_feed_forward_length": c.moe_intermediate_size,
            "expert_shared_count": c.num_shared_experts,
            "leading_dense_block_count": first_moe,
            "rope.dimension_count": c.qk_rope_head_dim,
            "attention.key_length": c.kv_lora_rank + c.qk_rope_head_dim,
            "attention.value_length": c.kv_lora_rank,
            "attention.key_length_mla": c.qk_nope_head_dim + c.qk_rope_head_dim,
            "attention.value_length_mla": c.v_head_dim,
            "attention.kv_lora_rank": c.kv_lora_rank,
            "ssm.conv_kernel": c.conv_size,
            "kda.head_dim": c.linear_head_dim,
        }
        if c.q_lora_rank:
            keys["attention.q_lora_rank"] = c.q_lora_rank
        if arch == "kimi-k3":
            keys["attn_res.block_size"] = c.attn_res_block_size or 0
            keys["activation.situ_beta"] = float(c.situ_beta)
            # llama.cpp: a linear beta <= 0 leaves `up` as it is, which k3 writes as None
            keys["activation.situ_linear_beta"] = float(c.situ_linear_beta or 0.0)
            if c.kda_gate == "safe":
                keys["kda.gate_lower_bound"] = float(c.kda_gate_lower_bound)
            if c.moe_latent_size:
                keys["expert_latent_length"] = c.moe_latent_size
    return {"block_count": c.num_layers, **keys}


def _stack(state: dict, prefix: str, n: int, part: str) -> torch.Tensor:
    return torch.stack([state[f"{prefix}.experts.{e}.{part}"] for e in range(n)])


def gguf_tensors(model, arch: str) -> Iterator[tuple[str, torch.Tensor | tuple]]:
    """(GGUF name, tensor) for every tensor of `model`, in the GGUF orientation (float32 or the model's
    dtype), or (name, ("mxfp4", packed, scale)) for routed experts held in MXFP4."""
    from .checkpoint import weights_to_save

    c = model.config
    state = weights_to_save(model)
    if c.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    if arch == "gpt2":
        yield from _gpt2_tensors(c, state)
        return
    yield "token_embd.weight", state["model.embed_tokens.weight"]
    yield "output_norm.weight", state["model.norm.weight"]
    yield "output.weight", state["lm_head.weight"]
    if c.attn_res_block_size:
        yield "output_res_score.weight", _res_score(state, "model.final_res")
    for i, (mixer, ffn) in enumerate(zip(c.layer_types, c.mlp_types)):
        p, b = f"model.layers.{i}", f"blk.{i}"
        yield f"{b}.attn_norm.weight", state[f"{p}.input_layernorm.weight"]
        yield f"{b}.ffn_norm.weight", state[f"{p}.post_attention_layernorm.weight"]
        if c.attn_res_block_size:
            yield f"{b}.attn_res_score.weight", _res_score(state, f"{p}.attn_res")
            yield f"{b}.ffn_res_score.weight", _res_score(state, f"{p}.mlp_res")
        yield from (_kda if mixer == "kda" else _mla)(c, state, f"{p}.self_attn", b, arch)
        yield from (_moe(c, state, f"{p}.block_sparse_moe", b) if ffn == "moe" else _dense(state, f"{p}.mlp", b))


def _res_score(state: dict, prefix: str) -> torch.Tensor:
    return state[f"{prefix}.norm.weight"].float().flatten() * state[f"{prefix}.proj.weight"].float().flatten()


def _kda(c, state: dict, p: str, b: str, arch: str):
    for x in "qkv":
        yield f"{b}.attn_{x}.weight", state[f"{p}.{x}_proj.weight"]
        conv = state[f"{p}.{x}_conv1d.weight"]
        yield f"{b}.ssm_conv1d_{x}.weight", conv.reshape(1, conv.shape[0], 1, conv.shape[-1])
    yield f"{b}.ssm_f_a.weight", state[f"{p}.f_a_proj.weight"]
    yield f"{b}.ssm_f_b.weight", state[f"{p}.f_b_proj.weight"]
    yield f"{b}.ssm_dt.bias", state[f"{p}.dt_bias"]
    a = -torch.exp(state[f"{p}.A_log"].float())
    yield f"{b}.ssm_a", a.flatten() if arch == "kimi-k3" else a.reshape(1, 1, -1, 1)
    yield f"{b}.ssm_beta.weight", state[f"{p}.b_proj.weight"]
    if c.linear_output_gate == "full":
        yield f"{b}.ssm_g.weight", state[f"{p}.g_proj.weight"]
    else:
        yield f"{b}.ssm_g_a.weight", state[f"{p}.g_a_proj.weight"]
        yield f"{b}.ssm_g_b.weight", state[f"{p}.g_b_proj.weight"]
    yield f"{b}.ssm_norm.weight", state[f"{p}.o_norm.weight"]
    yield f"{b}.attn_output.weight", state[f"{p}.o_proj.weight"]


def _mla(c, state: dict, p: str, b: str, arch: str):
    if c.q_lora_rank:
        yield f"{b}.attn_q_a.weight", state[f"{p}.q_a_proj.weight"]
        yield f"{b}.attn_q_a_norm.weight", state[f"{p}.q_a_layernorm.weight"]
        yield f"{b}.attn_q_b.weight", state[f"{p}.q_b_proj.weight"]
    else:
        yield f"{b}.attn_q.weight", state[f"{p}.q_proj.weight"]
    yield f"{b}.attn_kv_a_mqa.weight", state[f"{p}.kv_a_proj_with_mqa.weight"]
    yield f"{b}.attn_kv_a_norm.weight", state[f"{p}.kv_a_layernorm.weight"]
    kv_b = state[f"{p}.kv_b_proj.weight"].reshape(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
    k_b, v_b = kv_b.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)
    yield f"{b}.attn_k_b.weight", k_b.transpose(1, 2).contiguous()
    yield f"{b}.attn_v_b.weight", v_b.contiguous()
    if c.mla_output_gate:
        yield f"{b}.attn_gate.weight", state[f"{p}.g_proj.weight"]
    yield f"{b}.attn_output.weight", state[f"{p}.o_proj.weight"]


def _dense(state: dict, p: str, b: str):
    for gguf_part, part in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
        yield f"{b}.ffn_{gguf_part}.weight", state[f"{p}.{part}.weight"]


def _moe(c, state: dict, p: str, b: str):
    yield f"{b}.ffn_gate_inp.weight", state[f"{p}.gate.weight"]
    yield f"{b}.exp_probs_b.bias", state[f"{p}.gate.e_score_correction_bias"]
    n = c.num_experts
    for gguf_part, part in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
        name = f"{b}.ffn_{gguf_part}_exps.weight"
        if f"{p}.experts.0.{part}.weight_packed" in state:
            packed = _stack(state, p, n, f"{part}.weight_packed")
            yield name, ("mxfp4", packed, _stack(state, p, n, f"{part}.weight_scale"))
        else:
            yield name, _stack(state, p, n, part)
    if c.num_shared_experts:
        for gguf_part, part in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            yield f"{b}.ffn_{gguf_part}_shexp.weight", state[f"{p}.shared_experts.{part}.weight"]
    if c.moe_latent_size:
        yield f"{b}.ffn_routed_down.weight", state[f"{p}.latent_down_proj.weight"]
        yield f"{b}.ffn_routed_norm.weight", state[f"{p}.latent_norm.weight"]
        yield f"{b}.ffn_routed_up.weight", state[f"{p}.latent_up_proj.weight"]


def _gpt2_tensors(c, state: dict):
    yield "token_embd.weight", state["model.embed_tokens.weight"]
    yield "position_embd.weight", state["model.embed_positions.weight"]
    yield "output_norm.weight", state["model.norm.weight"]
    yield "output_norm.bias", state["model.norm.bias"]
    if not c.tie_word_embeddings:
        yield "output.weight", state["lm_head.weight"]
    parts = (
        ("attn_norm", "input_layernorm"),
        ("attn_qkv", "self_attn.c_attn"),
        ("attn_output", "self_attn.c_proj"),
        ("ffn_norm", "post_attention_layernorm"),
        ("ffn_up", "mlp.c_fc"),
        ("ffn_down", "mlp.c_proj"),
    )
    for i in range(c.num_layers):
        for gguf_part, part in parts:
            for kind in ("weight", "bias"):
                yield f"blk.{i}.{gguf_part}.{kind}", state[f"model.layers.{i}.{part}.{kind}"]


def mxfp4_blocks(packed: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
    """compressed-tensors MXFP4 (codes two a byte, element 2j low nibble; an E8M0 scale per 32) -> ggml's
    `block_mxfp4`: per group of 32, the scale byte then 16 bytes, byte j holding element j in the low
    nibble and element j + 16 in the high one. The same codes and scales: nothing is rounded."""
    *lead, rows, half = packed.shape
    groups = 2 * half // 32
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*lead, rows, groups, 32)
    blocks = codes[..., :16] | (codes[..., 16:] << 4)
    out = torch.cat((scale.reshape(*lead, rows, groups, 1), blocks), dim=-1)
    return out.reshape(*lead, rows, groups * 17).contiguous().numpy()


def _encode(name: str, t: torch.Tensor, outtype: str):
    """(data, ggml type) of one tensor in `outtype`, as llama.cpp's converter chooses."""
    from gguf import GGMLQuantizationType as Q
    from gguf import QuantError, quants

    data = t.detach().to(torch.float32).contiguous().numpy()
    qtype = {"f32": Q.F32, "bf16": Q.BF16, "q8_0": Q.Q8_0}[outtype]
    if data.ndim <= 1 or not name.endswith(".weight") or name.endswith("_norm.weight") or _FLOAT32_TENSORS.search(name):
        qtype = Q.F32
    try:
        encoded = quants.quantize(data, qtype)
    except QuantError:  # rows not a multiple of q8_0's 32
        qtype, encoded = Q.F16, quants.quantize(data, Q.F16)
    return encoded, qtype


def write_gguf(
    model,
    path: str | os.PathLike,
    outtype: str = "f32",
    tokenizer=None,
    chat_template: str | None = None,
    name: str | None = None,
) -> None:
    """`model` as one GGUF file at `path` (written there directly: the caller makes it all-or-nothing)."""
    import gguf

    if outtype not in OUTTYPES:
        raise ValueError(f"write_gguf: `outtype` must be one of {OUTTYPES}, got {outtype!r}")
    arch = gguf_architecture(model.config)
    writer = gguf.GGUFWriter(os.fspath(path), arch)
    writer.add_name(name or model.config.name)
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16}
    writer.add_file_type(file_type.get(outtype, gguf.LlamaFileType.MOSTLY_Q8_0))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value in gguf_metadata(model.config, arch).items():
        _add_key(writer, f"{arch}.{key}", value)
    if tokenizer is not None:
        add_tokenizer(writer, tokenizer, model.config.vocab_size)
    else:  # token ids in, logits out (llama.cpp's vocabulary type "none")
        writer.add_tokenizer_model("none")
    if chat_template:
        writer.add_chat_template(chat_template)
    for tensor_name, t in gguf_tensors(model, arch):
        if isinstance(t, tuple):  # MXFP4 experts: ggml's blocks, the same codes
            blocks = mxfp4_blocks(t[1], t[2])
            writer.add_tensor(tensor_name, blocks, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
            continue
        data, qtype = _encode(tensor_name, t, outtype)
        writer.add_tensor(tensor_name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_key(writer, key: str, value) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_array(key, list(value))


def add_tokenizer(writer, tokenizer, vocab_size: int) -> None:
    """k3's byte-level BPE (GPT-2's scheme: its pre-tokenizer regex, bytes as printable characters, merges
    by rank) as llama.cpp's "gpt2" tokenizer with the "gpt-2" pre-tokenizer, which splits text the same
    way; <|endoftext|> a control token, the beginning and end of text, no BOS added. Ids past the
    tokenizer's vocabulary (a model's embedding rows beyond it) are unused padding tokens."""
    import json

    from gguf import TokenType

    from ..tokenizer import EOT

    model = json.loads(tokenizer.inner.to_str())["model"]
    by_id = {i: t for t, i in tokenizer.inner.get_vocab(with_added_tokens=True).items()}
    tokens, types = [], []
    for i in range(vocab_size):
        token = by_id.get(i)
        tokens.append(token if token is not None else f"[PAD{i}]")
        types.append(TokenType.UNUSED if token is None else TokenType.CONTROL if token == EOT else TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    if not merges:  # gguf writes no empty array, and llama.cpp's "gpt2" vocabulary needs its merges
        raise ValueError(
            "the checkpoint's tokenizer.json has no merges (k3 train --tokenizer byte: bytes alone), and "
            "llama.cpp's BPE vocabulary needs them; export --format k3 (transformers) keeps this tokenizer, "
            "a model trained with a BPE tokenizer (k3 train's default) exports to GGUF, and a copy of the "
            "checkpoint without its tokenizer.json exports a GGUF file without one (token ids in and out)"
        )
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.eot_id)
    writer.add_eos_token_id(tokenizer.eot_id)
    writer.add_add_bos_token(False)
