"""Whether a checkpoint folder will load, found out before anything is allocated.

`check_pretrained(path)` reads what `CausalLM.from_pretrained(path)` reads, except the weights' data:
config.json, and the safetensors headers (names, shapes). It refuses, each with a one-line ValueError
that names the folder and the file:

- a damaged weights file (empty, truncated, not safetensors: the header does not cover the file);
- a model whose float32 weights are more than this machine's memory (the estimate in bytes);
- weights of other names or shapes than config.json's model (a config.json from another run), checked
  against the model built on the meta device, which holds no data.

`check_checkpoint(path)` also reads a training checkpoint's other files: tokenizer.json, and
trainer_state.pt where there is one (mapped: its tensors are not read).

The loading itself stays in `k3.models.checkpoint`; this module only asks whether it can succeed.
"""

from __future__ import annotations

import json
import os
import pickle
import zipfile
from pathlib import Path

import torch

from ..tokenizer import Tokenizer
from .checkpoint import convert_kimi_state_dict, load_into, read_config, restore_tied_head
from .config import ModelConfig
from .model import CausalLM
from .params import refuse_if_too_big


def check_pretrained(path: str | os.PathLike, what: str | None = None) -> ModelConfig:
    """The folder's ModelConfig, once its files are known to load (see the module); `what` names the
    folder in errors (e.g. "--checkpoint runs/k3")."""
    from safetensors import SafetensorError

    directory = Path(path)
    what = what or str(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{what}: no such folder (expected a checkpoint folder, e.g. k3 train --out)")
    try:
        config, native = read_config(directory)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what}: config.json is not valid JSON ({e}); it is damaged: restore it from the run "
                         f"that wrote it") from None
    refuse_if_too_big(config, 4, f"{what}: loading", "this checkpoint needs a machine with more memory")
    state = {}
    for file in _weight_files(directory):
        try:
            state.update(_header(file))
        except SafetensorError as e:
            raise ValueError(f"{what}: {file.name} is damaged or not a safetensors file ({e}); restore it from "
                             f"the run that wrote it") from None
    if not native:
        state = convert_kimi_state_dict(state, config)
    elif state and all(k.startswith("k3.") for k in state):  # saved by k3.hf.K3ForCausalLM
        state = {k[len("k3."):]: t for k, t in state.items()}
    with torch.device("meta"):
        model = CausalLM(config)
    load_into(model, restore_tied_head(state, config.tie_word_embeddings), what)
    return config


def check_checkpoint(path: str | os.PathLike, what: str | None = None) -> ModelConfig:
    """`check_pretrained`, and the folder's tokenizer.json and trainer_state.pt (where there is one)
    read: a folder written by `k3 train` that can be resumed, generated from or inspected."""
    what = what or str(path)
    config = check_pretrained(path, what)
    Tokenizer.load(path)
    state = Path(path) / "trainer_state.pt"
    if state.exists():
        try:
            if not zipfile.is_zipfile(state):
                raise RuntimeError("not a zip archive, which torch.save writes")
            torch.load(state, weights_only=True, mmap=True)
        except (RuntimeError, pickle.UnpicklingError, EOFError) as e:
            raise ValueError(f"{what}: trainer_state.pt is damaged or not written by k3 train "
                             f"({str(e).splitlines()[0]}); restore it from the run that wrote it") from None
    return config


def _weight_files(directory: Path) -> list[Path]:
    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    if single.exists():
        return [single]
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as e:
            raise ValueError(f"{index}: not a safetensors index (a JSON object with a `weight_map`): {e}") from None
        return [directory / shard for shard in shards]
    raise FileNotFoundError(f"{directory}: no model.safetensors or model.safetensors.index.json")


def _header(file: Path) -> dict[str, torch.Tensor]:
    """The file's tensors as meta tensors of their names and shapes (only the header is read)."""
    from safetensors import safe_open

    if not file.exists():
        raise FileNotFoundError(f"{file}: no such file (named by model.safetensors.index.json)")
    with safe_open(str(file), "pt") as f:
        return {name: torch.empty(f.get_slice(name).get_shape(), device="meta") for name in f.keys()}
