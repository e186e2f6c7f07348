"""Sharded training checkpoints: torch.distributed.checkpoint (DCP) files, each process writing its own
shards, inside k3's all-or-nothing commit.

`k3 train --parallel fsdp|ep` (and fsdp x ep) saves its checkpoint folder as

    dcp/.metadata, dcp/__R_0.distcp   the model's and the optimizer's tensors: rank R's shards
    config.json  tokenizer.json  trainer_state.pt (step, RNG states, history, optimizer groups)  loss.png

The DCP state dict holds `model.<parameter or buffer>` (k3's names; a tied head once, as the
embedding), `optimizer.<parameter>.<state>` (momentum_buffer, exp_avg, exp_avg_sq, step) and `step`.
Each process passes the tensors it holds: FSDP's DTensor shards, under ep its own experts; DCP writes a
tensor held whole by every process (ep's dense part) once. Nothing is gathered: rank R's file holds
rank R's shards, its optimizer states beside them.

A save (`save_sharded`) is one commit of k3.io: the main process locks and recovers the folder and
makes a temporary folder in it (`shared_staging`); every process writes its DCP file there and hashes
it; the main process writes the small files, then moves the DCP files and its own into place under
one journal (`commit_files`), removing the previous set's files that the new one lacks (a
model.safetensors, the files of a save by more processes). A kill at any instant leaves the previous
checkpoint or the new one.

A load (`load_sharded`) reads into what this process holds, whatever the layout that wrote it: DCP
takes each tensor's slices from the files that have them, so a checkpoint of 4 processes under fsdp x ep
2 resumes on 2 under fsdp, or on one process. `CausalLM.from_pretrained` and `k3 export` read the model
part one tensor at a time (`k3.checkpoints.loading`).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
from torch import nn

from ..checkpoints.checkpoint import MODEL_PREFIX, raise_mismatch

OPTIMIZER_PREFIX = "optimizer."


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors as this process holds them (DTensor shards under fsdp), a tied head dropped
    (the embedding holds it): what a sharded checkpoint saves and loads in place."""
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of `t` (a DTensor's local shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


def state_to_save(model: nn.Module, optimizer_state: dict, step: int) -> dict:
    """The DCP state dict of a save: this process's model tensors, its optimizer states by parameter name
    (`optimizer_state`: {name: {state: tensor}}) and the step."""
    return {"model": model_state(model), "optimizer": optimizer_state, "step": torch.tensor(step)}


def load_sharded(folder, model: nn.Module, optimizer_template: dict[str, nn.Parameter], no_dist: bool) -> dict:
    """Read this process's part of the sharded checkpoint in `folder` (its `dcp/`): the model's tensors
    in place, and the optimizer states of the parameters `optimizer_template` names, allocated as their
    parameter is placed. Returns {name: {state: tensor}} for those parameters. `no_dist`: one process,
    no process group. A checkpoint of another model is a ValueError listing what does not fit."""
    from ..checkpoints.checkpoint import load_sharded_state, sharded_reader

    reader = sharded_reader(folder)
    saved = reader.read_metadata().state_dict_metadata
    weights = model_state(model)
    missing = sorted(n for n in weights if MODEL_PREFIX + n not in saved)
    shapes = sorted(f"{n}: checkpoint {list(saved[MODEL_PREFIX + n].size)}, model {list(t.shape)}"
                    for n, t in weights.items() if MODEL_PREFIX + n in saved and saved[MODEL_PREFIX + n].size != t.shape)
    unexpected = []
    if no_dist:  # (with processes, the other processes' experts are in the checkpoint and not here)
        unexpected = sorted(k[len(MODEL_PREFIX):] for k in saved
                            if k.startswith(MODEL_PREFIX) and k[len(MODEL_PREFIX):] not in weights)
    raise_mismatch(f"checkpoint {folder}", missing, unexpected, shapes)
    states: dict[str, dict] = {}
    for key, meta in saved.items():
        if key.startswith(OPTIMIZER_PREFIX):
            name, state = key[len(OPTIMIZER_PREFIX):].rsplit(".", 1)
            if name in optimizer_template:
                p = optimizer_template[name]
                if meta.size == p.shape:  # placed as the parameter (a DTensor's shards)
                    t = torch.empty_like(p, dtype=meta.properties.dtype, requires_grad=False)
                else:  # a scalar (AdamW's step)
                    t = torch.empty(meta.size, dtype=meta.properties.dtype, device=local(p).device)
                states.setdefault(name, {})[state] = t
    with torch.no_grad():
        load_sharded_state({"model": weights, "optimizer": states}, reader, no_dist)
    return {name: {k: v.detach() for k, v in s.items()} for name, s in states.items()}


def save_sharded(strategy, out: Path, tokenizer, cfg, step: int, max_steps: int | None, generator: torch.Generator,
                 history: dict) -> None:
    """Write the sharded checkpoint of `strategy`'s model and optimizer to the folder `out`, every process
    its own shards (see the module), or raise CheckpointError on every process and leave `out` as it
    was. Called by every process of the run alike; `strategy` gives the collectives (share, gather,
    on_main) and, for the optimizer's groups, the single-process names (`saved_groups`)."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as save_dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ..io import commit_files, describe, shared_staging
    from ..checkpoints.checkpoint import SHARDED
    from .checkpoint import first_non_finite, refuse_non_finite, saving, sharded_run_files
    from .optim import flat_names, group_names, named_state, portable_state

    model, optimizer = strategy.model, strategy.optimizer
    local_state = optimizer.state_dict()
    names = flat_names(group_names(model, optimizer))
    state = state_to_save(model, named_state(local_state, names)["state"], step)
    bad = strategy.gather(first_non_finite(state["model"]))
    refuse_non_finite(strategy.share(next((b for b in bad if b), None) if strategy.is_main else None), out, step)
    held = {}

    def begin() -> str:
        held["staging"] = shared_staging(out)
        return str(held["staging"].__enter__())

    with saving(out):
        staging = Path(strategy.share(strategy.on_main(begin)))
    try:
        with saving(out), warnings.catch_warnings():  # DCP raises on every process when one fails
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            try:
                save_dcp(state, storage_writer=FileSystemWriter(staging), no_dist=strategy.world_size == 1)
            except CheckpointException as e:  # (a BaseException) -> the first process's own error
                rank, (failure, _) = next(iter(e.failures.items()))
                if not isinstance(failure, Exception):  # a Ctrl-C there stays one
                    raise failure from None
                raise RuntimeError(f"process {rank}: {type(failure).__name__}: {failure}") from failure
        files = sorted(p.name for p in staging.iterdir())  # every process's, and the .metadata
        mine = {name: describe(staging / name) for i, name in enumerate(files)
                if i % strategy.world_size == strategy.rank}
        parts = strategy.gather(mine)

        def commit() -> None:
            described = {f"{SHARDED}/{name}": d for part in parts for name, d in part.items()}
            groups = [{**g, "params": full}
                      for g, full in zip(portable_state(local_state)["param_groups"], strategy.saved_groups())]
            writers = {f"{SHARDED}/{name}": _mover(staging / name) for name in files}
            writers.update(sharded_run_files(model, tokenizer, cfg, step, max_steps, generator, history, groups))
            with saving(out):
                commit_files(out, writers, step=step, manifest=True, described=described)

        strategy.on_main(commit)
    finally:
        if "staging" in held:
            held["staging"].__exit__(None, None, None)


def _mover(source: Path):
    """A writer that moves the file `source` (written by a process into the staging folder) into place."""
    return lambda tmp: os.replace(source, tmp)
