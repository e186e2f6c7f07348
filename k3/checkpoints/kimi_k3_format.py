"""Kimi K3's published checkpoint layout (Hugging Face `moonshotai/Kimi-K3`), both ways.

- config.json: a multimodal wrapper (`model_type: "kimi_k3"`, `KimiK3ForConditionalGeneration`) with
  the text model in `text_config` (`model_type: "kimi_linear"`, K3's fields by their published names,
  `k3.checkpoints.hf_config`) and, when the routed experts are quantized, its `quantization_config`
  (compressed-tensors MXFP4).
- Tensor names: the text model's under `language_model.` (`language_model.model.…`,
  `language_model.lm_head.weight`), the vision side's under `vision_tower.` / `mm_projector.` (k3 skips
  them). Kimi Linear's names otherwise, except:

      k3                                       published
      model.layers.N.attn_res.{norm,proj}      model.layers.N.self_attention_res_{norm,proj}
      model.layers.N.mlp_res.{norm,proj}       model.layers.N.mlp_res_{norm,proj}
      model.final_res.{norm,proj}              model.output_attn_res_{norm,proj}
      block_sparse_moe.latent_down_proj        block_sparse_moe.routed_expert_down_proj
      block_sparse_moe.latent_norm             block_sparse_moe.routed_expert_norm
      block_sparse_moe.latent_up_proj          block_sparse_moe.routed_expert_up_proj
      self_attn.A_log [1, 1, H, 1]             self_attn.A_log [head_dim] float32, the first H entries used
      experts.E.w1                             experts.E.w1.weight (bf16) or .weight_packed / .weight_scale (MXFP4)

- dtypes: float32 for KDA's small per-channel tensors (`self_attn.A_log`, `dt_bias`, the short
  convolutions `{q,k,v}_conv1d.weight`, the output norm `o_norm.weight`) and the router's
  `e_score_correction_bias`; uint8 for the MXFP4 experts' codes and scales; bfloat16 for the rest.
  Written back in the same dtypes, a published checkpoint read by k3 exports to the same bytes.
"""

from __future__ import annotations

import math
import re
from typing import Callable, NamedTuple

import torch

from ..ops import mxfp4
from .hf_config import CONTEXT_LENGTH, MXFP4_FORMAT, MXFP4_WEIGHTS, config_to_hf

PREFIX = "language_model."
VISION_PREFIXES = ("vision_tower.", "mm_projector.")
# (k3's name ending, the published one); every entry is a whole `.name.weight` ending
RENAMES = (
    (".attn_res.norm.weight", ".self_attention_res_norm.weight"),
    (".attn_res.proj.weight", ".self_attention_res_proj.weight"),
    (".mlp_res.norm.weight", ".mlp_res_norm.weight"),
    (".mlp_res.proj.weight", ".mlp_res_proj.weight"),
    ("model.final_res.norm.weight", "model.output_attn_res_norm.weight"),
    ("model.final_res.proj.weight", "model.output_attn_res_proj.weight"),
    (".latent_down_proj.weight", ".routed_expert_down_proj.weight"),
    (".latent_norm.weight", ".routed_expert_norm.weight"),
    (".latent_up_proj.weight", ".routed_expert_up_proj.weight"),
)
# the tensors the published checkpoint stores in float32 (name endings)
FLOAT32_TENSORS = (
    "self_attn.A_log",
    "self_attn.dt_bias",
    "self_attn.q_conv1d.weight",
    "self_attn.k_conv1d.weight",
    "self_attn.v_conv1d.weight",
    "self_attn.o_norm.weight",
    "gate.e_score_correction_bias",
)
QUANTIZED_PARTS = (".weight_packed", ".weight_scale")
EXPERT_MATRIX = re.compile(r"block_sparse_moe\.experts\.\d+\.w[123]$")
QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": MXFP4_FORMAT,
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "format": MXFP4_FORMAT,
            "weights": {**MXFP4_WEIGHTS, "scale_dtype": "torch.uint8", "dynamic": False},
            "input_activations": None,
            "output_activations": None,
        }
    },
    # everything that is not a routed expert
    "ignore": [
        "re:.*lm_head$",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        r"re:.*\.mlp\..*",
        r"re:.*block_sparse_moe\.gate$",
        r"re:.*routed_expert_(down|up)_proj$",
        "re:vision_tower.*",
        "re:mm_projector.*",
    ],
}


def is_vision(key: str) -> bool:
    return key.startswith(VISION_PREFIXES)


def to_kimi_name(key: str) -> str:
    """A published text tensor's name -> its Kimi Linear-layout name (prefix stripped, K3's names
    mapped); `checkpoint.kimi_tensor_name` takes it from there to k3's."""
    key = key.removeprefix(PREFIX)
    for k3_end, published_end in RENAMES:
        if key.endswith(published_end):
            return key[: -len(published_end)] + k3_end
    return key


def to_published_name(key: str) -> str:
    """A k3 parameter name -> its published name (an MXFP4 expert's `experts.E.w1` -> `experts.E.w1.weight`,
    to which the caller appends `_packed` / `_scale`)."""
    if EXPERT_MATRIX.search(key):
        return PREFIX + key + ".weight"
    for k3_end, published_end in RENAMES:
        if key.endswith(k3_end):
            return PREFIX + key[: -len(k3_end)] + published_end
    return PREFIX + key


def unpad_a_log(t: torch.Tensor, num_heads: int, key: str) -> torch.Tensor:
    """A published `A_log` [head_dim] (padded) -> k3's [1, 1, H, 1]: its first H entries. Kimi Linear's
    own [1, 1, H, 1] passes through."""
    if t.dim() != 1:
        return t
    if t.numel() < num_heads:
        raise ValueError(
            f"{key}: a 1-D A_log must hold at least `linear_num_heads` = {num_heads} entries, got {t.numel()}"
        )
    return t[:num_heads].reshape(1, 1, num_heads, 1)


def pad_a_log(t: torch.Tensor, head_dim: int, padding: torch.Tensor | None = None) -> torch.Tensor:
    """k3's A_log [1, 1, H, 1] -> the published [head_dim] float32: the H values, then `padding` (the
    entries after the first H of the checkpoint k3 read it from, which no model uses: kept so that a
    published checkpoint exports to the same bytes) or zeros."""
    heads = t.numel()
    out = torch.zeros(max(head_dim, heads), dtype=torch.float32)
    out[:heads] = t.detach().flatten().float()
    if padding is not None:
        if padding.shape != (out.numel() - heads,):
            raise ValueError(
                f"pad_a_log: `padding` must hold {out.numel() - heads} entries (head_dim {head_dim} - "
                f"{heads} heads), got shape {list(padding.shape)}"
            )
        out[heads:] = padding.float()
    return out


def a_log_padding(published: dict[str, torch.Tensor], num_heads: int, head_dim: int) -> dict[str, torch.Tensor]:
    """{published name: the entries after the first `num_heads`} of each A_log among `published`
    (tensors under their published names) padded as the layout pads it (1-D, `head_dim` entries), for
    `published_entries` to write back."""
    return {
        k: t[num_heads:]
        for k, t in published.items()
        if k.startswith(PREFIX) and k.endswith("self_attn.A_log") and t.dim() == 1 and t.numel() == head_dim > num_heads
    }


def stored_dtype(key: str, t: torch.Tensor) -> torch.dtype:
    """The dtype a k3 tensor is written in: float32 for the published float32 tensors (FLOAT32_TENSORS),
    else bfloat16; integer tensors keep theirs."""
    if not t.is_floating_point():
        return t.dtype
    return torch.float32 if key.endswith(FLOAT32_TENSORS) else torch.bfloat16


def published_config(config: ModelConfig, quantized: bool) -> dict:
    """The published config.json for `config` (quantized: routed experts in MXFP4). Refuses what the
    layout cannot hold, naming the field."""
    problems = [
        what
        for bad, what in (
            (config.rope_theta is not None, "RoPE in MLA (rope_theta; K3's MLA is NoPE)"),
            (
                config.linear_output_gate not in ("low_rank", "full"),
                f"KDA output gate {config.linear_output_gate!r} (low_rank or full)",
            ),
            (
                config.linear_num_heads > config.linear_head_dim and "kda" in config.layer_types,
                f"more KDA heads ({config.linear_num_heads}) than `linear_head_dim` ({config.linear_head_dim}): "
                f"A_log is stored as [head_dim]",
            ),
            (
                quantized
                and config.num_experts
                and ((config.moe_latent_size or config.hidden_size) % 32 or config.moe_intermediate_size % 32),
                "MXFP4 experts need the expert's input and hidden sizes to be multiples of 32",
            ),
        )
        if bad
    ]
    if problems:
        raise ValueError(f"{config.name!r} cannot be written in Kimi K3's published layout: " + "; ".join(problems))
    text = {**config_to_hf(config), "max_position_embeddings": CONTEXT_LENGTH}
    if quantized and config.num_experts:
        text["quantization_config"] = QUANTIZATION_CONFIG
    return {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "tie_word_embeddings": config.tie_word_embeddings,
        "ignore_index": -100,
        "text_config": text,
    }


class Entry(NamedTuple):
    """One tensor of a published checkpoint, made on demand: its name, shape, dtype and maker."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def published_entries(model, quantize: bool, a_log_pad: dict[str, torch.Tensor] | None = None) -> list[Entry]:
    """The tensors of `model` in the published layout, in the model's order (`quantize`: routed experts in
    MXFP4: codes an MXFP4 model holds are written as they are, full-precision experts are encoded;
    otherwise MXFP4 experts are decoded to bfloat16), each in its published dtype (`stored_dtype`).
    `a_log_pad`: A_log padding by published name (`a_log_padding` of the checkpoint the model was read
    from), zeros where absent. Nothing is computed until an entry's `make`."""
    from .checkpoint import weights_to_save

    state = weights_to_save(model)
    head_dim = model.config.linear_head_dim
    entries: list[Entry] = []
    for key, t in state.items():
        if key.endswith(".weight_scale"):
            continue  # written with its `.weight_packed`
        if key.endswith(".weight_packed"):  # an MXFP4Expert's matrix
            base, scale = key[: -len(".weight_packed")], state[key[: -len("packed")] + "scale"]
            if quantize:
                entries += [
                    Entry(PREFIX + key, tuple(t.shape), t.dtype, lambda t=t: t),
                    Entry(PREFIX + base + ".weight_scale", tuple(scale.shape), scale.dtype, lambda s=scale: s),
                ]
            else:
                shape = (t.shape[0], 2 * t.shape[1])
                entries.append(
                    Entry(
                        PREFIX + base + ".weight",
                        shape,
                        torch.bfloat16,
                        lambda t=t, s=scale: mxfp4.decode(t, s, torch.bfloat16),
                    )
                )
            continue
        name = to_published_name(key)
        if quantize and EXPERT_MATRIX.search(key):
            rows, cols = t.shape
            codes = {}  # encode once for both parts

            def part(i, t=t, codes=codes):
                if "pair" not in codes:
                    codes["pair"] = mxfp4.encode(t)
                return codes["pair"][i] if i == 0 else codes.pop("pair")[i]

            entries += [
                Entry(name + "_packed", (rows, cols // 2), torch.uint8, lambda p=part: p(0)),
                Entry(name + "_scale", (rows, cols // mxfp4.GROUP_SIZE), torch.uint8, lambda p=part: p(1)),
            ]
        elif key.endswith("self_attn.A_log"):
            pad = (a_log_pad or {}).get(name)
            entries.append(
                Entry(
                    name, (max(head_dim, t.numel()),), torch.float32, lambda t=t, pad=pad: pad_a_log(t, head_dim, pad)
                )
            )
        else:
            dtype = stored_dtype(key, t)
            entries.append(Entry(name, tuple(t.shape), dtype, lambda t=t, d=dtype: t.to(d).contiguous()))
    return entries
