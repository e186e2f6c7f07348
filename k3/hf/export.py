"""`k3 export`: a k3 checkpoint directory -> a directory transformers loads.

Two formats:

- "k3" (default, any k3 model): what K3ForCausalLM.save_pretrained writes — config.json with
  model_type "k3" and the k3 ModelConfig under "k3", model.safetensors with k3's names under `k3.`,
  generation_config.json. Loads with AutoModelForCausalLM after `import k3.hf`, and with k3's own
  CausalLM.from_pretrained.
- "kimi-linear" (kimi-linear* models): Kimi Linear's own format — config.json with model_type
  "kimi_linear" in the Hub's spelling (`hf_config.kimi_linear_config`, which refuses what Kimi Linear
  cannot express) and model.safetensors in the Hub's names (`checkpoint.kimi_state_dict`). Loads with
  transformers' KimiLinearForCausalLM (transformers 5), no k3 needed.

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

FORMATS = ("k3", "kimi-linear")


def export(checkpoint: str | os.PathLike, out: str | os.PathLike, format: str = "k3") -> list[str]:
    """Write `checkpoint` (a k3 training or model checkpoint directory) to `out` in `format`;
    returns the names of the files written."""
    from ..models import CausalLM
    from ..models.hf_config import kimi_linear_config
    from ..tokenizer import Tokenizer

    if format not in FORMATS:
        raise ValueError(f"export: `format` must be one of {FORMATS}, got {format!r}")
    checkpoint, out = Path(checkpoint), Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"export: the output {out} exists and is not a directory")
    model = CausalLM.from_pretrained(checkpoint).eval()
    tokenizer = Tokenizer.load(checkpoint) if (checkpoint / "tokenizer.json").exists() else None
    # Kimi Linear's config.json, made (or refused) before anything is written
    kimi_config = kimi_linear_config(model.config) if format == "kimi-linear" else None
    special = {} if tokenizer is None else dict(bos_token_id=tokenizer.eot_id, eos_token_id=tokenizer.eot_id)
    with staging_folder(out) as staging:
        if kimi_config is None:
            _write_k3(model, staging, special)
        else:
            _write_kimi_linear(model, kimi_config, staging, special)
        if tokenizer is not None:
            _write_tokenizer(tokenizer, model.config, staging)
        return move_files_into(staging, out)


def _write_k3(model, directory: Path, special: dict) -> None:
    from .modeling import K3ForCausalLM

    K3ForCausalLM.from_k3(model, **special).save_pretrained(directory)


def _write_kimi_linear(model, config: dict, directory: Path, special: dict) -> None:
    from safetensors.torch import save_file

    from ..models.checkpoint import kimi_state_dict

    dtype = str(model.lm_head.weight.dtype).removeprefix("torch.")
    # pad_token_id explicitly: KimiLinearConfig's default (163839) would be outside a small vocabulary
    config.update({"bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "torch_dtype": dtype, **special})
    save_file(kimi_state_dict(model), directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def _write_tokenizer(tokenizer, config, directory: Path) -> None:
    from ..tokenizer import EOT

    tokenizer.save(directory / "tokenizer.json")
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOT, "eos_token": EOT,
                "clean_up_tokenization_spaces": False}  # decode must give back k3's text exactly
    if config.max_position_embeddings:
        settings["model_max_length"] = config.max_position_embeddings
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
