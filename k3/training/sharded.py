"""Saving a sharded training checkpoint: torch.distributed.checkpoint (DCP) files, each process writing
its own shards, inside k3's all-or-nothing commit.

`k3 train --parallel fsdp|ep` (and fsdp x ep) saves its checkpoint folder as

    dcp/.metadata, dcp/__R_0.distcp   the model's and the optimizer's tensors: rank R's shards
    config.json  tokenizer.json  trainer_state.pt (step, RNG states, history, optimizer groups)  loss.png

The format (the DCP state dict's names, writing it, reading it back at any layout) is
`k3.checkpoints.dcp`'s; this module is the save of a run: the optimizer's states named by parameter
(`k3.training.optim`), a check that nothing saved is non-finite, and the commit.

A save (`save_sharded`) is one commit of k3.io: the main process locks and recovers the folder and
makes a temporary folder in it (`shared_staging`); every process writes its DCP file there and hashes
it; the main process writes the small files, then moves the DCP files and its own into place under
one journal (`commit_files`), removing the previous set's files that the new one lacks (a
model.safetensors, the files of a save by more processes). A kill at any instant leaves the previous
checkpoint or the new one. A load is `k3.checkpoints.dcp.load_sharded`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..checkpoints.dcp import SHARDED, save_sharded_state, state_to_save


def save_sharded(
    strategy, out: Path, tokenizer, cfg, step: int, max_steps: int | None, generator: torch.Generator, history: dict
) -> None:
    """Write the sharded checkpoint of `strategy`'s model and optimizer to the folder `out`, every process
    its own shards (see the module), or raise CheckpointError on every process and leave `out` as it
    was. Called by every process of the run alike; `strategy` gives the collectives (share, gather,
    on_main) and, for the optimizer's groups, the single-process names (`saved_groups`)."""
    from ..io import commit_files, describe, shared_staging
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
        with saving(out):  # DCP raises on every process when one fails
            save_sharded_state(state, staging, no_dist=strategy.world_size == 1)
        files = sorted(p.name for p in staging.iterdir())  # every process's, and the .metadata
        mine = {
            name: describe(staging / name) for i, name in enumerate(files) if i % strategy.world_size == strategy.rank
        }
        parts = strategy.gather(mine)

        def commit() -> None:
            described = {f"{SHARDED}/{name}": d for part in parts for name, d in part.items()}
            groups = [
                {**g, "params": full}
                for g, full in zip(portable_state(local_state)["param_groups"], strategy.saved_groups())
            ]
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
