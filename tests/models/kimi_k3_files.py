"""Tiny checkpoints in Kimi K3's published layout, written here from the issue's description (not with
k3's own writer): the wrapper config.json with `text_config`, `language_model.` names, K3's AttnRes and
latent-MoE names, A_log [head_dim] float32 with padding, the published dtypes (F32 for KDA's A_log,
dt_bias, short convolutions and o_norm and the router's correction bias, U8 for the MXFP4 routed experts'
codes and scales, BF16 for the rest), vision tensors to skip, and three shards with an index in which an
expert's codes and scales can sit in different shards.

`write_published` returns the truth: every k3 parameter's expected value (what loading must give).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from k3.checkpoints.hf_config import config_to_hf
from k3.models import CausalLM, get_config
from k3.ops import mxfp4

# k3 name ending -> the published one (issue 14's table)
PUBLISHED_NAMES = [
    (".attn_res.norm.weight", ".self_attention_res_norm.weight"),
    (".attn_res.proj.weight", ".self_attention_res_proj.weight"),
    (".mlp_res.norm.weight", ".mlp_res_norm.weight"),
    (".mlp_res.proj.weight", ".mlp_res_proj.weight"),
    ("model.final_res.norm.weight", "model.output_attn_res_norm.weight"),
    ("model.final_res.proj.weight", "model.output_attn_res_proj.weight"),
    (".latent_down_proj.weight", ".routed_expert_down_proj.weight"),
    (".latent_norm.weight", ".routed_expert_norm.weight"),
    (".latent_up_proj.weight", ".routed_expert_up_proj.weight"),
]
# stored F32 in the published checkpoint (with full float32 values here: a bf16 round trip would show)
FLOAT32 = (
    "self_attn.A_log",
    "self_attn.dt_bias",
    "self_attn.q_conv1d.weight",
    "self_attn.k_conv1d.weight",
    "self_attn.v_conv1d.weight",
    "self_attn.o_norm.weight",
    "e_score_correction_bias",
)
SATURATING = 30.0  # A_log padding: exp(30) * (f + dt_bias) would pin every gate at -5 or 0
QUANT = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "format": "mxfp4-pack-quantized",
            "weights": {
                "num_bits": 4,
                "type": "float",
                "symmetric": True,
                "strategy": "group",
                "group_size": 32,
                "scale_dtype": "torch.uint8",
            },
        }
    },
    "ignore": ["re:.*lm_head$", "re:.*self_attn.*", "re:.*shared_experts.*"],
}


def tiny_config(**overrides):
    return get_config("kimi-k3-tiny", **{"vocab_size": 512, **overrides})


def published_name(key: str) -> str:
    for k3_end, end in PUBLISHED_NAMES:
        if key.endswith(k3_end):
            return "language_model." + key[: -len(k3_end)] + end
    return "language_model." + key


def write_published(
    directory: Path, config=None, seed: int = 0, canonical: bool = False, shards: int = 3
) -> dict[str, torch.Tensor]:
    """Write a published-layout checkpoint of `config` (kimi-k3-tiny by default) with random values
    (bf16-exact where stored BF16; experts from random MXFP4 bytes, or `canonical`: from the encoder)
    -> the k3 truth."""
    config = config or tiny_config()
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = CausalLM(config).state_dict()
    truth, files = {}, {}
    heads, head_dim = config.linear_num_heads, config.linear_head_dim
    for key, meta in shapes.items():
        if re.search(r"experts\.\d+\.w[123]$", key):
            rows, cols = meta.shape
            if canonical:
                w = torch.randn(rows, cols, generator=g) * 0.05
                packed, scale = mxfp4.encode(w)
            else:
                packed = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8)
                scale = torch.randint(118, 125, (rows, cols // 32), generator=g, dtype=torch.uint8)
            files[f"language_model.{key}.weight_packed"] = packed
            files[f"language_model.{key}.weight_scale"] = scale
            truth[key] = mxfp4.decode(packed, scale)
            continue
        t = torch.randn(meta.shape, generator=g) * 0.1
        if not key.endswith(FLOAT32):
            t = t.to(torch.bfloat16).float()
        if key.endswith("self_attn.A_log"):
            padded = torch.full((head_dim,), SATURATING)
            padded[:heads] = t.flatten()
            files[published_name(key)] = padded
        elif key.endswith(FLOAT32):
            files[published_name(key)] = t
        else:
            files[published_name(key)] = t.to(torch.bfloat16)
        truth[key] = t
    files["vision_tower.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2).to(torch.bfloat16)
    files["mm_projector.proj.0.weight"] = torch.randn(16, 8).to(torch.bfloat16)
    names = list(files)
    weight_map = {}
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(shards):
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: files[k].contiguous() for k in names[i::shards]}  # round robin: codes and scales apart
        save_file(part, directory / shard)
        weight_map.update({k: shard for k in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    text = config_to_hf(config)
    text["quantization_config"] = QUANT
    wrapper = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "text_config": text}
    (directory / "config.json").write_text(json.dumps(wrapper))
    return truth
