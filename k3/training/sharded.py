"""Saving a sharded training checkpoint: torch.distributed.checkpoint (DCP) files, each process writing
its own shards, inside k3's all-or-nothing commit.

`k3 train --parallel ddp|fsdp|ep` (and fsdp x ep) saves its checkpoint folder as

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
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoints.dcp import SHARDED, async_save_sharded_state, save_sharded_state, state_to_save, wait_sharded_state


def save_sharded(
    ckpt,
    out: Path,
    tokenizer,
    cfg,
    step: int,
    max_steps: int | None,
    generator: torch.Generator,
    history: dict,
    asynchronous: bool = False,
    group=None,
) -> "PendingSave | None":
    """Write the sharded checkpoint of `ckpt`'s model and optimizer (a k3.training.checkpointer.Checkpointer)
    to the folder `out`, every process its own shards (see the module), or raise CheckpointError on every
    process and leave `out` as it was. Called by every process of the run alike; `ckpt.dims` gives the
    collectives (share, gather, on_main), `ckpt.groups` the optimizer groups' single-process names.

    `asynchronous` (`k3 train --async-checkpoint`): return once the state is copied to CPU memory, the DCP
    files written by a thread (collectives on `group`, a gloo group of the checkpoint's own): a
    `PendingSave` whose `finish()` (every process alike, when `done()` everywhere or at the latest before
    the next save and at the end of training) waits for them and commits. Until then `out` holds the
    previous checkpoint; a kill at any point leaves the one or the other."""
    from ..io import shared_staging
    from .checkpoint import first_non_finite, refuse_non_finite, saving, sharded_run_files
    from .optim import flat_names, group_names, named_state, portable_state

    model, optimizer, dims = ckpt.model, ckpt.optimizer, ckpt.dims
    local_state = optimizer.state_dict()
    names = flat_names(group_names(model, optimizer))
    state = state_to_save(model, named_state(local_state, names)["state"], step)
    bad = dims.gather(first_non_finite(state["model"]))
    refuse_non_finite(dims.share(next((b for b in bad if b), None) if dims.is_main else None), out, step)
    groups = [
        {**g, "params": full} for g, full in zip(portable_state(local_state)["param_groups"], ckpt.groups)
    ]  # the small files' writers, made now: they hold the run's state as it is at this step
    small = sharded_run_files(model, tokenizer, cfg, step, max_steps, generator, history, groups, ckpt.corpus)
    held = {}

    def begin() -> str:
        held["staging"] = shared_staging(out)
        return str(held["staging"].__enter__())

    with saving(out):
        staging = Path(dims.share(dims.on_main(begin)))
    pending = PendingSave(dims, out, staging, held, small, step)
    try:
        with saving(out):  # DCP raises on every process when one fails
            if asynchronous:
                pending.future = async_save_sharded_state(state, staging, dims.world == 1, group)
                return pending
            save_sharded_state(state, staging, no_dist=dims.world == 1)
    except BaseException:
        pending.close()
        raise
    pending.finish()
    return None


@dataclass
class PendingSave:
    """A sharded save whose DCP files are written (or being written) into its staging folder: `finish()`
    waits for them, hashes them (each process its share), and the main process commits them with the
    small files (k3.io's journal), then the staging folder goes. `future`: the background write's, when
    the save is asynchronous."""

    dims: object  # the processes' ParallelDims (k3.training.parallel)
    out: Path
    staging: Path
    held: dict
    small: dict
    step: int
    future: object = None

    def done(self) -> bool:
        """Whether this process's files are written (an asynchronous save), without waiting."""
        return self.future is None or self.future.done()

    def finish(self) -> None:
        from ..io import commit_files, describe
        from .checkpoint import saving

        dims, out, staging = self.dims, self.out, self.staging
        try:
            if self.future is not None:
                with saving(out):
                    wait_sharded_state(self.future)
            files = sorted(p.name for p in staging.iterdir())  # every process's, and the .metadata
            mine = {name: describe(staging / name) for i, name in enumerate(files) if i % dims.world == dims.rank}
            parts = dims.gather(mine)

            def commit() -> None:
                described = {f"{SHARDED}/{name}": d for part in parts for name, d in part.items()}
                writers = {f"{SHARDED}/{name}": _mover(staging / name) for name in files}
                writers.update(self.small)
                with saving(out):
                    commit_files(out, writers, step=self.step, manifest=True, described=described)

            dims.on_main(commit)
        finally:
            self.close()

    def close(self) -> None:
        """Remove the staging folder (what was not committed)."""
        if "staging" in self.held:
            self.held.pop("staging").__exit__(None, None, None)


def _mover(source: Path):
    """A writer that moves the file `source` (written by a process into the staging folder) into place."""
    return lambda tmp: os.replace(source, tmp)
