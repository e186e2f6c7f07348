"""Training checkpoints: one directory holding

    model.safetensors   the weights (k3 names)           config.json   {"k3": model config, "train": run config}
    tokenizer.json      the tokenizer                    trainer_state.pt   optimizer, step, schedule length,
    loss.png            the loss curve                                      RNG states, history

Saving writes every file to a temporary name first and renames them into place only once all are
complete, so a failure while writing (a full disk, Ctrl-C) leaves the previous checkpoint as it was.
`CausalLM.from_pretrained(dir)` reads the model part of it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ..io import atomic_write_files
from ..models.checkpoint import restore_tied_head, weights_to_save
from ..tokenizer import Tokenizer
from .config import TrainConfig
from .optim import portable_state
from .plot import plot_history

FILES = ("model.safetensors", "config.json", "tokenizer.json", "trainer_state.pt", "loss.png")


class CheckpointError(OSError):
    """Saving failed; the previous checkpoint is intact."""


def save_training_checkpoint(out, model, optimizer, tokenizer, cfg, step: int, max_steps: int | None,
                             generator: torch.Generator, history: dict, *, weights: dict | None = None,
                             optimizer_state: dict | None = None) -> None:
    """Write the checkpoint directory `out` whole, or raise CheckpointError and leave it as it was.
    `weights` and `optimizer_state` stand for the model's and optimizer's own state dicts when those
    are spread over processes (k3.training.distributed gathers them)."""
    from safetensors.torch import save_file

    out = Path(out)
    state = weights_to_save(model, weights)
    optimizer_state = portable_state(optimizer.state_dict() if optimizer_state is None else optimizer_state)
    writers = {
        "model.safetensors": lambda p: save_file(state, p, metadata={"format": "pt", "step": str(step)}),
        "config.json": lambda p: Path(p).write_text(json.dumps(
            {"k3": model.config.to_dict(), "train": dataclasses.asdict(cfg), "step": step}, indent=2)),
        "tokenizer.json": tokenizer.save,
        "trainer_state.pt": lambda p: torch.save({
            "optimizer": optimizer_state, "step": step, "max_steps": max_steps,
            "data_rng": generator.get_state(), "torch_rng": torch.get_rng_state(), "history": history}, p),
        "loss.png": lambda p: plot_history(history, p, title=f"{model.config.name}, step {step}"),
    }
    try:
        atomic_write_files(out, writers)
    except OSError as e:
        raise CheckpointError(f"could not save the checkpoint to {out}: {e.strerror or e}; the previous "
                              f"checkpoint there (if any) is intact") from e


def load_training_checkpoint(path) -> dict:
    """Everything `train` needs to continue: configs, weights, optimizer, RNG states, history."""
    from safetensors.torch import load_file

    path = Path(path)
    missing = [f for f in FILES[:4] if not (path / f).exists()]
    if missing:
        raise FileNotFoundError(f"--resume {path}: not a k3 training checkpoint (missing {', '.join(missing)})")
    config = json.loads((path / "config.json").read_text())
    state = torch.load(path / "trainer_state.pt", weights_only=True)
    weights = restore_tied_head(load_file(path / "model.safetensors"), bool(config["k3"].get("tie_word_embeddings")))
    return {**state, "train_config": TrainConfig(**config["train"]), "model": weights,
            "tokenizer": Tokenizer.load(path / "tokenizer.json")}
