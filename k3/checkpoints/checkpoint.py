"""Weights in and out: k3's own checkpoints and Hugging Face Kimi Linear / Kimi K3 checkpoints.

A directory with `config.json` and `model.safetensors` (or shards listed in
`model.safetensors.index.json`). k3 writes its config under the key "k3" (so does k3.hf's K3Config,
whose weights carry the prefix `k3.`); anything else is read as a Kimi `config.json`
(`ModelConfig.from_hf`). `k3.checkpoints.loading` reads the tensors one at a time with the mappings here;
Kimi K3's published layout (`language_model.` and K3's own names) is `k3.checkpoints.kimi_k3_format`'s.
Kimi Linear weights come in two layouts, both mapped to k3's names here:

- the Hub's (also what transformers' save_pretrained writes): k3's names except
  `...experts.N.w{1,2,3}.weight` (k3: `experts.N.w{1,2,3}`) and a dense first layer that transformers
  saves under `block_sparse_moe.` (k3: `mlp.`);
- transformers' in-memory one: one depthwise conv over q|k|v (`self_attn.conv1d.weight` [3D, 1, W]),
  the gate under `self_attn.forget_gate.`, MoE under `mlp.` with experts fused into
  `experts.gate_up_proj` [E, 2h, d] and `experts.down_proj` [E, d, h].
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from ..io import CheckpointError, atomic_write_files, read_json


def _layer_ffn(config: ModelConfig, key: str) -> str | None:
    m = re.match(r"model\.layers\.(\d+)\.", key)
    return config.mlp_types[int(m.group(1))] if m and int(m.group(1)) < config.num_layers else None


def convert_kimi_state_dict(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Map a Kimi checkpoint's tensors (either layout above) to k3's parameter names."""
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        out.update(convert_kimi_tensor(key, t, config))
    return out


def kimi_tensor_name(key: str, config: ModelConfig) -> str:
    """The k3 name of a Kimi checkpoint tensor that maps one to one (everything but the fused tensors of
    transformers' in-memory layout, which `convert_kimi_tensor` splits)."""
    ffn = _layer_ffn(config, key)
    key = key.replace("self_attn.forget_gate.", "self_attn.")
    if ffn == "moe":
        key = key.replace(".mlp.", ".block_sparse_moe.")
    elif ffn == "dense":
        key = key.replace(".block_sparse_moe.", ".mlp.")
    return re.sub(r"(experts\.\d+\.w[123])\.weight$", r"\1", key)


def convert_kimi_tensor(key: str, t: torch.Tensor, config: ModelConfig) -> dict[str, torch.Tensor]:
    """One Kimi checkpoint tensor -> {k3 name: tensor}: one entry, or several for a fused tensor."""
    if key.endswith("self_attn.conv1d.weight"):  # transformers: fused q|k|v short convolution
        prefix = key[: -len("conv1d.weight")]
        return {f"{prefix}{name}_conv1d.weight": part for name, part in zip(("q", "k", "v"), t.chunk(3, dim=0))}
    key = kimi_tensor_name(key, config)
    if key.endswith("experts.gate_up_proj"):  # transformers: [E, 2h, d], gate rows then up rows
        prefix = key[: -len("gate_up_proj")]
        gate, up = t.chunk(2, dim=1)
        out = {}
        for e in range(t.shape[0]):
            out[f"{prefix}{e}.w1"], out[f"{prefix}{e}.w3"] = gate[e], up[e]
        return out
    if key.endswith("experts.down_proj"):  # transformers: [E, d, h]
        prefix = key[: -len("down_proj")]
        return {f"{prefix}{e}.w2": w2 for e, w2 in enumerate(t)}
    return {key: t}


def kimi_state_dict(model) -> dict[str, torch.Tensor]:
    """The inverse of convert_kimi_state_dict, to the Hub's layout: k3's tensors as they go to disk
    (weights_to_save), routed experts renamed `experts.N.w{1,2,3}` -> `experts.N.w{1,2,3}.weight`.
    Whether Kimi Linear's code computes the same model is `hf_config.kimi_linear_config`'s question."""
    return {re.sub(r"(experts\.\d+\.w[123])$", r"\1.weight", k): t for k, t in weights_to_save(model).items()}


def weights_to_save(model, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The model's tensors (or `state`, its state dict gathered from several processes) as they go to
    disk: contiguous, and a tied head stored once (as the embedding)."""
    state = {k: v.detach().contiguous() for k, v in (model.state_dict() if state is None else state).items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def restore_tied_head(state: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """Undo `weights_to_save` for a tied head: lm_head.weight is the embedding."""
    if tied and "model.embed_tokens.weight" in state:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    return state


def read_config(directory: Path, config_class) -> tuple[ModelConfig, bool]:
    """(config, is_k3_checkpoint) from directory/config.json; `config_class`: the config's class
    (k3.models.ModelConfig, `CausalLM.config_class`), with its `from_dict` and `from_hf`."""
    path = directory / "config.json"
    if not path.exists():
        raise FileNotFoundError(
            f"{directory}: no config.json (expected a checkpoint folder: config.json and "
            f"model.safetensors, or shards listed in model.safetensors.index.json)"
        )
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object (a model configuration), got {type(raw).__name__}")
    if "k3" in raw:
        return config_class.from_dict(raw["k3"]), True
    return config_class.from_hf(raw), False


def load_into(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Strict load with an error that lists what is missing, unexpected or mis-shaped."""
    own = model.state_dict()
    shapes = sorted(
        f"{k}: checkpoint {list(state[k].shape)}, model {list(own[k].shape)}"
        for k in set(own) & set(state)
        if state[k].shape != own[k].shape
    )
    raise_mismatch(source, sorted(set(own) - set(state)), sorted(set(state) - set(own)), shapes)
    model.load_state_dict(state, strict=True)


def raise_mismatch(source: str, missing: list[str], unexpected: list[str], shapes: list[str]) -> None:
    """The error of a checkpoint that does not fit the model (nothing when all three lists are empty)."""
    if missing or unexpected or shapes:

        def head(items):
            return ", ".join(items[:8]) + (f", ... ({len(items)} in all)" if len(items) > 8 else "")

        problems = [
            f"missing {head(missing)}" if missing else "",
            f"unexpected {head(unexpected)}" if unexpected else "",
            f"shape mismatch {head(shapes)}" if shapes else "",
        ]
        raise ValueError(f"{source} does not match the model's configuration: " + "; ".join(p for p in problems if p))


def save_pretrained(model, path: str | os.PathLike) -> None:
    """Write path/model.safetensors and path/config.json (k3 layout) as one set (`k3.io.atomic_write_files`):
    a failure raises CheckpointError and leaves the folder's earlier files as they were."""
    from safetensors.torch import save_file

    state = weights_to_save(model)
    config = json.dumps({"k3": model.config.to_dict()}, indent=2)
    try:
        atomic_write_files(
            path,
            {
                "model.safetensors": lambda tmp: save_file(state, tmp, metadata={"format": "pt"}),
                "config.json": lambda tmp: Path(tmp).write_text(config),
            },
        )
    except CheckpointError:
        raise
    except Exception as e:  # a full disk reaches us as OSError or SafetensorError
        detail = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"
        raise CheckpointError(
            f"could not save the model to {path}: {detail}; the files there before (if any) are intact"
        ) from e
