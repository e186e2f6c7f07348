"""Sharded checkpoints: torch.distributed.checkpoint (DCP) files, read and written.

`k3 train --parallel fsdp|ep` (and fsdp x ep) saves its checkpoint folder with its tensors in `dcp/`
(`.metadata`, and `__R_0.distcp`: rank R's shards), beside config.json, tokenizer.json and
trainer_state.pt. The DCP state dict holds `model.<parameter or buffer>` (k3's names; a tied head once,
as the embedding), `optimizer.<parameter>.<state>` (momentum_buffer, exp_avg, exp_avg_sq, step) and
`step`. Each process passes the tensors it holds: FSDP's DTensor shards, under ep its own experts; DCP
writes a tensor held whole by every process (ep's dense part) once. Nothing is gathered: rank R's file
holds rank R's shards, its optimizer states beside them.

This module is the format: the names above, writing a state dict (`save_sharded_state`), reading into
what this process holds whatever the layout that wrote it (`load_sharded`: DCP takes each tensor's
slices from the files that have them, so a checkpoint of 4 processes under fsdp x ep 2 resumes on 2
under fsdp, or on one process), and reading one whole tensor at a time (`read_sharded_tensor`, for
`from_pretrained` and `k3 export`, `k3.checkpoints.loading`). The save itself, one all-or-nothing commit
of every process's files with the optimizer's states named by parameter, is the training loop's
(`k3.training.sharded.save_sharded`).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path

import torch
from torch import nn

from ..io import CheckpointError
from .checkpoint import raise_mismatch

SHARDED = "dcp"  # a sharded checkpoint's folder of torch.distributed.checkpoint files (.metadata, __R_I.distcp)
MODEL_PREFIX = "model."  # its model tensors' keys; the optimizer's are "optimizer.<parameter>.<state>"
OPTIMIZER_PREFIX = "optimizer."


def is_sharded(directory: str | os.PathLike) -> bool:
    """Whether the folder holds a sharded checkpoint (`k3 train --parallel fsdp|ep` writes one): its
    weights are torch.distributed.checkpoint files in `dcp/`, each process's own shards."""
    return (Path(directory) / SHARDED / ".metadata").is_file()


def sharded_reader(directory: str | os.PathLike):
    """A torch.distributed.checkpoint FileSystemReader of the folder's `dcp/` files that reads their
    metadata once (tensors are then read one by one, each load asking for it again)."""
    from torch.distributed.checkpoint import FileSystemReader

    class OnceReader(FileSystemReader):
        def read_metadata(self):
            if not hasattr(self, "_metadata"):
                self._metadata = super().read_metadata()
            return self._metadata

    return OnceReader(Path(directory) / SHARDED)


def load_sharded_state(state: dict, reader, no_dist: bool) -> None:
    """torch.distributed.checkpoint.load of `state` (its tensors filled in place) from `reader`; `no_dist`:
    this process alone (DCP's warning that it assumes so is the intent, not news)."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        try:
            load(state, storage_reader=reader, no_dist=no_dist)
        except CheckpointException as e:  # (a BaseException) -> one line naming the folder
            rank, (failure, _) = next(iter(e.failures.items()))
            if not isinstance(failure, Exception):
                raise failure from None
            raise CheckpointError(
                f"{reader.path}: its files could not be read (process {rank}: "
                f"{type(failure).__name__}: {failure}); they are damaged or incomplete: restore "
                f"the checkpoint from a copy"
            ) from None


def read_sharded_tensor(reader, key: str, meta=None) -> torch.Tensor:
    """The whole tensor `key` of a sharded checkpoint (its shards, from every file that holds one),
    on the CPU; `meta`: its TensorStorageMetadata, when the caller has it."""
    meta = meta or reader.read_metadata().state_dict_metadata[key]
    t = torch.empty(meta.size, dtype=meta.properties.dtype)
    load_sharded_state({key: t}, reader, no_dist=True)
    return t


def sharded_step(directory: str | os.PathLike) -> int | None:
    """The step a sharded checkpoint's tensors were saved at (None where not recorded)."""
    reader = sharded_reader(directory)
    if "step" not in reader.read_metadata().state_dict_metadata:
        return None
    return int(read_sharded_tensor(reader, "step"))


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
    reader = sharded_reader(folder)
    saved = reader.read_metadata().state_dict_metadata
    weights = model_state(model)
    missing = sorted(n for n in weights if MODEL_PREFIX + n not in saved)
    shapes = sorted(
        f"{n}: checkpoint {list(saved[MODEL_PREFIX + n].size)}, model {list(t.shape)}"
        for n, t in weights.items()
        if MODEL_PREFIX + n in saved and saved[MODEL_PREFIX + n].size != t.shape
    )
    unexpected = []
    if no_dist:  # (with processes, the other processes' experts are in the checkpoint and not here)
        unexpected = sorted(
            k[len(MODEL_PREFIX) :]
            for k in saved
            if k.startswith(MODEL_PREFIX) and k[len(MODEL_PREFIX) :] not in weights
        )
    raise_mismatch(f"checkpoint {folder}", missing, unexpected, shapes)
    states: dict[str, dict] = {}
    for key, meta in saved.items():
        if key.startswith(OPTIMIZER_PREFIX):
            name, state = key[len(OPTIMIZER_PREFIX) :].rsplit(".", 1)
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


def save_sharded_state(state: dict, directory: str | os.PathLike, no_dist: bool) -> None:
    """torch.distributed.checkpoint.save of `state` (`state_to_save`'s) into `directory`, this process
    writing its own file; called by every process alike (`no_dist`: this process alone). A failure raises
    on every process (DCP's rule): a RuntimeError naming the first process's own error."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as save_dcp

    with _quiet(), dcp_errors():
        save_dcp(state, storage_writer=FileSystemWriter(directory), no_dist=no_dist)


def async_save_sharded_state(state: dict, directory: str | os.PathLike, no_dist: bool, group=None):
    """`save_sharded_state` in the background (torch.distributed.checkpoint.async_save): `state` is copied
    to CPU memory before this returns (the training may change the model then), and the files are written
    by a thread whose collectives run on `group` (a gloo group of the checkpoint's own, so they never
    interleave with the training's). Returns the write's Future: `wait_sharded_state` it."""
    from torch.distributed.checkpoint import FileSystemWriter, async_save

    with _quiet(), dcp_errors():
        return async_save(state, storage_writer=FileSystemWriter(directory), no_dist=no_dist, process_group=group)


def wait_sharded_state(future) -> None:
    """Wait for an `async_save_sharded_state` write; its failure raises as `save_sharded_state`'s does."""
    with dcp_errors():
        future.result()


@contextlib.contextmanager
def _quiet():
    """Without DCP's warning that a one-process (`no_dist`) save runs without torch.distributed."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


@contextlib.contextmanager
def dcp_errors():
    """DCP's CheckpointException (a BaseException, one entry per failed process) as the first process's own
    error: a RuntimeError naming it (a Ctrl-C there stays one)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        rank, (failure, _) = next(iter(e.failures.items()))
        if not isinstance(failure, Exception):
            raise failure from None
        raise RuntimeError(f"process {rank}: {type(failure).__name__}: {failure}") from failure
