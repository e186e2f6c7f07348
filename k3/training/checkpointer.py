"""The one checkpointer of a training run, for every mode (torchtitan's CheckpointManager): it saves the
model and the optimizer with the run's small files, loads them back at resume, and keeps at most one
asynchronous save in flight.

- One process writes the checkpoint whole: model.safetensors, trainer_state.pt (the optimizer state in
  torch's own numbering) and the small files (k3.training.checkpoint.save_training_checkpoint).
- Under torchrun every mode's parameters are DTensors (FSDP2, k3.training.parallel), so every mode saves
  the same way: each process writes its own shards with torch.distributed.checkpoint (DCP) inside
  k3's all-or-nothing commit (k3.training.sharded), in the background with `asynchronous`
  (`--async-checkpoint`: torchtitan's, on a gloo group of its own).

Either format resumes at any process count and in any mode: a whole checkpoint is loaded into a whole
model before the split and its optimizer state placed as each parameter is; a sharded one is read into
the split model (k3.checkpoints.dcp.load_sharded). The optimizer state is named by parameter, in the
single-process numbering (`groups`), whatever the split.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .checkpoint import save_training_checkpoint
from .optim import flat_names, group_names, load_keeping_implementation, named_state, numbered_state
from .parallel import ParallelDims


class Checkpointer:
    """Saves and loads `model` and `optimizer` (as `build` made them) for the processes `dims`; `groups`:
    the optimizer groups' parameter names as one process numbers them; `corpus`: the token streams'
    fingerprint, saved with each checkpoint and checked at resume."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        dims: ParallelDims,
        groups: list[list[str]],
        corpus: str | None = None,
        asynchronous: bool = False,
    ):
        self.model, self.optimizer, self.dims, self.groups, self.corpus = model, optimizer, dims, groups, corpus
        self.asynchronous = asynchronous
        self._pending = None  # an asynchronous save being written (k3.training.sharded.PendingSave)
        self._group = None
        if asynchronous:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo")  # the background writes' collectives, apart

    # -- saving ---------------------------------------------------------------------------------------
    def save(
        self,
        out,
        tokenizer,
        cfg,
        step: int,
        max_steps: int | None,
        generator: torch.Generator,
        history: dict,
    ) -> None:
        """The checkpoint of this step into the folder `out` (see the module), written all or nothing."""
        if self.dims.world == 1:
            weights, optimizer_state = self.full_state()  # on the CPU: a checkpoint written on a GPU resumes anywhere
            save_training_checkpoint(
                out,
                self.model,
                self.optimizer,
                tokenizer,
                cfg,
                step,
                max_steps,
                generator,
                history,
                weights=weights,
                optimizer_state=optimizer_state,
                corpus=self.corpus,
            )
            return
        from .sharded import save_sharded

        self.finish()  # one save at a time, in order
        self._reshard()
        self._pending = save_sharded(
            self, Path(out), tokenizer, cfg, step, max_steps, generator, history, self.asynchronous, self._group
        )

    def poll(self) -> None:
        """After a step: commit the asynchronous save once every process has written its files (one flag
        all-reduced a step while one is pending)."""
        if self._pending is not None and not self.dims.any(not self._pending.done()):
            self.finish()

    def finish(self) -> None:
        """Wait for an asynchronous save still being written, and commit it."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.finish()

    def _reshard(self) -> None:
        """After a forward without backward (an evaluation) FSDP's root stays unsharded: shard it again,
        so that state dicts hold the shards."""
        from torch.distributed.fsdp import FSDPModule

        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def full_state(self) -> tuple[dict | None, dict | None]:
        """The single-process model and optimizer state dicts (full tensors, the optimizer's in torch's own
        numbering), on the CPU, on rank 0 (None, None elsewhere): every sharded tensor made whole over
        its mesh, then rank 0 takes the routed experts it does not hold, with their optimizer states, from
        the ranks that do. What a one-process run of the same steps holds (the multi-process tests)."""
        model, optimizer = self.model, self.optimizer
        if self.dims.world == 1:
            return to_cpu(model.state_dict()), to_cpu(optimizer.state_dict())
        from torch.distributed.tensor import DTensor

        from .parallel import held_expert_parameters

        def whole(t):
            return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()

        self._reshard()
        # the experts other ranks hold and rank 0 does not (none unless they are split over ranks)
        held = {id(p) for p in held_expert_parameters(model)} if self.dims.experts_split else set()
        experts = {n for n, p in model.named_parameters() if id(p) in held}
        weights = {n: whole(t) for n, t in model.state_dict().items()}
        local = named_state(optimizer.state_dict(), flat_names(group_names(model, optimizer)))
        state = {
            n: {k: whole(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for n, s in local["state"].items()
        }
        if not self.dims.is_main:  # the dense rest, and rank 0's own experts, rank 0 has whole
            weights = {n: t for n, t in weights.items() if n in experts}
            state = {n: s for n, s in state.items() if n in experts}
        parts = self.dims.gather((weights, state))
        if not self.dims.is_main:
            return None, None
        weights, state = {}, {}
        for part_weights, part_state in parts:
            for n, t in part_weights.items():
                weights.setdefault(n, t)
            for n, s in part_state.items():
                state.setdefault(n, s)
        groups = [{**g, "params": names} for g, names in zip(local["param_groups"], self.groups)]
        return weights, numbered_state({"state": state, "param_groups": groups})

    # -- loading --------------------------------------------------------------------------------------
    def load(self, state: dict) -> None:
        """Fill the optimizer (and, from a sharded checkpoint, the model: a whole one's weights are
        loaded before the split) from `state`, a `load_training_checkpoint` result."""
        if state["model"] is not None:
            load_keeping_implementation(self.optimizer, lambda: self._load_whole_optimizer(state["optimizer"]))
        else:
            self._load_sharded(state["sharded"], state["optimizer"])

    def _load_whole_optimizer(self, saved: dict) -> None:
        """A single-process optimizer state dict (full tensors, torch's numbering) into this process's
        part: each parameter's state placed as the parameter is (a DTensor's, on its mesh)."""
        if self.dims.world == 1:
            self.optimizer.load_state_dict(saved)
            return
        from torch.distributed.tensor import DTensor, distribute_tensor

        full = named_state(saved, flat_names(self.groups))
        groups = group_names(self.model, self.optimizer)
        params = dict(self.model.named_parameters())
        state = {}
        for name in flat_names(groups):
            if name not in full["state"]:  # (an expert no token chose yet has no state)
                continue
            p = params[name]
            state[name] = {
                k: distribute_tensor(v.to(self.dims.device), p.device_mesh, p.placements, src_data_rank=None)
                if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.shape == p.shape
                else v
                for k, v in full["state"][name].items()
            }
        mine = {
            "state": state,
            "param_groups": [{**g, "params": names} for g, names in zip(full["param_groups"], groups)],
        }
        self.optimizer.load_state_dict(numbered_state(mine))

    def _load_sharded(self, folder, saved: dict) -> None:
        """The model and the optimizer, this process's part of them, from the sharded checkpoint in
        `folder` (k3.checkpoints.dcp); `saved`: its trainer_state.pt's optimizer entry, the groups with
        their parameters' names in the single-process order."""
        from ..checkpoints.dcp import load_sharded

        names = group_names(self.model, self.optimizer)
        params = dict(self.model.named_parameters())
        states = load_sharded(
            folder, self.model, {n: params[n] for n in flat_names(names)}, no_dist=self.dims.world == 1
        )
        groups = [{**g, "params": mine} for g, mine in zip(saved["param_groups"], names)]
        load_keeping_implementation(
            self.optimizer,
            lambda: self.optimizer.load_state_dict(numbered_state({"state": states, "param_groups": groups})),
        )


def to_cpu(obj):
    """Every tensor in `obj` (nested dicts, lists, tuples) detached and on the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj
