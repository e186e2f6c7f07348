"""`k3 export`: a checkpoint directory (anything `CausalLM.from_pretrained` reads) -> a directory in a
published format.

Three formats:

- "k3" (default, any k3 model): what K3ForCausalLM.save_pretrained writes — config.json with
  model_type "k3" and the k3 ModelConfig under "k3", model.safetensors with k3's names under `k3.`,
  generation_config.json, and transformers' remote code: an `auto_map` in config.json naming
  configuration_k3.py and modeling_k3.py, beside it (`k3.hf.remote_code`: they import k3's classes). Loads with AutoModelForCausalLM after `import k3.hf`, or with `trust_remote_code=True` in
  an interpreter that never imported k3 (k3 installed), and with k3's own CausalLM.from_pretrained.
- "kimi-linear" (kimi-linear* models): Kimi Linear's own format — config.json with model_type
  "kimi_linear" in the Hub's spelling (`hf_config.kimi_linear_config`, which refuses what Kimi Linear
  cannot express) and model.safetensors in the Hub's names (`checkpoint.kimi_state_dict`). Loads with
  transformers' KimiLinearForCausalLM (transformers 5), no k3 needed.
- "kimi-k3" (KDA/MLA models): Kimi K3's published layout (`k3.models.kimi_k3_format`) — config.json
  with `text_config` and the published field names, tensors under `language_model.` with K3's names,
  A_log padded to [head_dim], sharded safetensors (`model-0000i-of-0000n.safetensors`) with
  `model.safetensors.index.json`; with `quantize="mxfp4"` the routed experts in compressed-tensors
  MXFP4 (codes that the source already holds are copied byte for byte).

When the checkpoint has a tokenizer.json (k3 train writes one), it is copied with a
tokenizer_config.json naming PreTrainedTokenizerFast, so AutoTokenizer.from_pretrained(dir) loads it,
and the config's bos/eos token is <|endoftext|>. Every file is written to a temporary folder beside
the output first and moved into place once all are complete (`k3.io`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..io import move_files_into, staging_folder

FORMATS = ("k3", "kimi-linear", "kimi-k3")
QUANTIZE = (None, "mxfp4")
MAX_SHARD_BYTES = 5 * 10**9  # transformers' default shard size, "5GB"


def export(checkpoint: str | os.PathLike, out: str | os.PathLike, format: str = "k3", quantize: str | None = None,
           max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """Write `checkpoint` (a k3 training or model checkpoint directory, or any checkpoint
    `CausalLM.from_pretrained` reads) to `out` in `format`; `quantize="mxfp4"` (kimi-k3 only) stores
    the routed experts in MXFP4. Returns the names of the files written."""
    from ..models import CausalLM
    from ..models.hf_config import kimi_linear_config
    from ..models.kimi_k3_format import published_config
    from ..tokenizer import Tokenizer

    if format not in FORMATS:
        raise ValueError(f"export: `format` must be one of {FORMATS}, got {format!r}")
    if quantize not in QUANTIZE or (quantize and format != "kimi-k3"):
        raise ValueError(f"export: `quantize` must be one of {QUANTIZE} (mxfp4 with format 'kimi-k3' only), "
                         f"got {quantize!r} with format {format!r}")
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"export: `max_shard_bytes` must be a positive int, got {max_shard_bytes!r}")
    checkpoint, out = Path(checkpoint), Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"export: the output {out} exists and is not a directory")
    model = CausalLM.from_pretrained(checkpoint, experts=quantize).eval()
    tokenizer = Tokenizer.load(checkpoint) if (checkpoint / "tokenizer.json").exists() else None
    # Kimi Linear's config.json, made (or refused) before anything is written
    kimi_config = kimi_linear_config(model.config) if format == "kimi-linear" else None
    k3_config = published_config(model.config, quantize == "mxfp4") if format == "kimi-k3" else None
    special = {} if tokenizer is None else dict(bos_token_id=tokenizer.eot_id, eos_token_id=tokenizer.eot_id)
    with staging_folder(out) as staging:
        if k3_config is not None:
            _write_kimi_k3(model, k3_config, staging, special, quantize == "mxfp4", max_shard_bytes)
        elif kimi_config is None:
            _write_k3(model, staging, special)
        else:
            _write_kimi_linear(model, kimi_config, staging, special)
        if tokenizer is not None:
            _write_tokenizer(tokenizer, model.config, staging)
        return move_files_into(staging, out)


def _write_k3(model, directory: Path, special: dict) -> None:
    from .modeling import K3ForCausalLM

    K3ForCausalLM.from_k3(model, **special).save_pretrained(directory)  # with the remote code


def _write_kimi_linear(model, config: dict, directory: Path, special: dict) -> None:
    from safetensors.torch import save_file

    from ..models.checkpoint import kimi_state_dict

    dtype = str(model.lm_head.weight.dtype).removeprefix("torch.")
    # pad_token_id explicitly: KimiLinearConfig's default (163839) would be outside a small vocabulary
    config.update({"bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "torch_dtype": dtype, **special})
    save_file(kimi_state_dict(model), directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def _write_kimi_k3(model, config: dict, directory: Path, special: dict, quantize: bool, max_shard_bytes: int) -> None:
    """Kimi K3's published layout: shards of at most `max_shard_bytes` (a bigger tensor gets one of its
    own), each tensor made when its shard is written, and the index."""
    from safetensors.torch import save_file

    from ..models.kimi_k3_format import published_entries

    shards: list[list] = [[]]
    size = 0
    for entry in published_entries(model, quantize):
        if shards[-1] and size + entry.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({e.name: e.make() for e in shard}, directory / name, metadata={"format": "pt"})
        weight_map.update({e.name: name for e in shard})
    total = sum(e.nbytes for shard in shards for e in shard)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.update({"torch_dtype": "bfloat16", **special})
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def _write_tokenizer(tokenizer, config, directory: Path) -> None:
    from ..tokenizer import EOT

    tokenizer.save(directory / "tokenizer.json")
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOT, "eos_token": EOT,
                "clean_up_tokenization_spaces": False}  # decode must give back k3's text exactly
    if config.max_position_embeddings:
        settings["model_max_length"] = config.max_position_embeddings
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
