"""How a run is spread over processes for what lies around the training step: `SingleProcess` here,
and its subclass for the torchrun modes, `Distributed` (k3.training.distributed), which changes how the
data, the model, checkpoints and agreement reach the processes.

A strategy prepares the data (`prepare`), splits the model and builds its optimizer (`setup`), takes
one optimizer step on the global batch (`step`: the free function k3.training.step.train_step, with the
strategy's `dims`), measures validation bits per byte over all processes (`evaluate`: k3.training.step's),
saves and resumes checkpoints (`save`, `load_optimizer`, `load_sharded`), and lets the processes agree
(`share`, `any`, `is_main`, `close`). What the step and the evaluation need to know of the other
processes is the strategy's `dims` (k3.training.parallel.ParallelDims), not methods of the strategy.
"""

from __future__ import annotations

import torch
from torch import nn

from ..models import CausalLM
from ..runtime import cxx_compiler, resolve_device
from ..tokenizer import Tokenizer
from .checkpoint import save_training_checkpoint
from .config import TrainConfig
from .data import TokenData, prepare
from .optim import build_optimizer, flat_names, group_names, load_keeping_implementation, numbered_state
from .parallel import ParallelDims, apply_recompute
from .step import NonFiniteLossError, evaluate, train_step, training_step

__all__ = ["SingleProcess", "NonFiniteLossError", "training_step", "to_cpu", "compile_decoder"]


class SingleProcess:
    """A run on this process alone, on one device (`device`: "auto" picks CUDA, then MPS, then the
    CPU); no torch.distributed."""

    def __init__(self, device: str = "auto"):
        self.dims = ParallelDims(device=resolve_device(device))
        self.model: CausalLM | None = None  # the model, as the single process sees it
        self.net: nn.Module | None = None  # the module to call in training (a wrapper, or `model`)
        self.optimizer: torch.optim.Optimizer | None = None
        self.precision = "fp32"
        self.grad_norm: float | None = None  # the last step's gradient norm before clipping
        self.max_logit: float | None = None  # the last step's largest attention logit (QK-Clip on)
        self.qk_clipped_heads: int | None = None  # ... and the heads QK-Clip scaled down after it
        self.corpus: str | None = None  # the token streams' fingerprint, saved with each checkpoint

    @property
    def device(self) -> torch.device:
        """This process's device."""
        return self.dims.device

    @property
    def rank(self) -> int:
        """This process's rank (0 on one process)."""
        return self.dims.rank

    @property
    def world_size(self) -> int:
        """The number of processes."""
        return self.dims.world

    @property
    def is_main(self) -> bool:
        """The process that logs and writes."""
        return self.dims.rank == 0

    def describe(self) -> str:
        """How the run is split, for the opening message ("" on one process)."""
        return ""

    def close(self) -> None:
        """Release what the strategy holds (a process group)."""

    def poll_save(self) -> None:
        """After a step: commit an asynchronous save whose files every process has written (none here)."""

    def finish_save(self) -> None:
        """Wait for an asynchronous save still being written and commit it (none here)."""

    # -- data and model -------------------------------------------------------------------------------
    def prepare(self, cfg: TrainConfig, tokenizer: Tokenizer | None = None) -> tuple[Tokenizer, TokenData]:
        """The run's tokenizer and token streams (k3.training.data.prepare)."""
        return prepare(cfg, tokenizer)

    def share_here(self, cfg: TrainConfig, whole: bool = False) -> float:
        """The part of the model's training state this machine holds: all of it."""
        return 1.0

    def new_model(self, config, to_load: bool = False) -> CausalLM:
        """The model to train, initialised (`to_load`: its weights will be loaded from a checkpoint)."""
        return CausalLM(config)

    def setup(self, model: CausalLM, cfg: TrainConfig) -> None:
        """Take `model` (the same on every process) for training on this process's device and build
        its optimizer."""
        if cfg.async_checkpoint:
            raise ValueError(
                "k3 train: --async-checkpoint writes a sharded (DCP) checkpoint in the background: it needs "
                "torchrun with --parallel fsdp or ep; a one-process run saves in one piece (drop the flag)"
            )
        model.to(self.device)
        apply_recompute(model, cfg.recompute)
        if cfg.compile:
            compile_decoder(model, fullgraph=True)
        self.model = self.net = model
        self.optimizer = build_optimizer(model, cfg)
        self.precision = cfg.precision

    # -- the training step and evaluation (k3.training.step) ------------------------------------------
    def step(self, windows: torch.Tensor, cfg: TrainConfig) -> float:
        """`train_step` on the global batch `windows` [B, T + 1]; returns the batch's loss and keeps the
        step's gradient norm, largest attention logit and clipped heads for the log."""
        result = train_step(self.model, self.optimizer, windows, cfg, self.dims, self.net)
        self.grad_norm, self.max_logit, self.qk_clipped_heads = (
            result.grad_norm,
            result.max_logit,
            result.qk_clipped_heads,
        )
        return result.loss

    def evaluate(self, data: TokenData, windows: torch.Tensor) -> float:
        """Validation bits per byte over `windows` [n, T + 1], all processes together."""
        return evaluate(self.model, data, windows, self.dims, self.precision)

    # -- checkpoints ----------------------------------------------------------------------------------
    def save(
        self,
        out,
        tokenizer: Tokenizer,
        cfg: TrainConfig,
        step: int,
        max_steps: int | None,
        generator: torch.Generator,
        history: dict,
    ) -> None:
        """`save_training_checkpoint` of the whole model and optimizer, written by the main process."""
        weights, optimizer_state = self.full_state()
        self.on_main(
            lambda: save_training_checkpoint(
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
        )

    def full_state(self) -> tuple[dict | None, dict | None]:
        """The single-process model and optimizer state dicts on the main process (None elsewhere), on
        the CPU (a checkpoint written on a GPU resumes anywhere)."""
        if self.device.type == "cpu":
            return self.model.state_dict(), self.optimizer.state_dict()
        return to_cpu(self.model.state_dict()), to_cpu(self.optimizer.state_dict())

    def load_optimizer(self, saved: dict) -> None:
        """Load a single-process optimizer state dict (full tensors, torch's numbering)."""
        load_keeping_implementation(self.optimizer, lambda: self.optimizer.load_state_dict(saved))

    def saved_groups(self) -> list[list[str]]:
        """The names of each optimizer group's parameters as one process numbers them: what a checkpoint
        records, whatever the split."""
        return group_names(self.model, self.optimizer)

    def load_sharded(self, folder, saved: dict) -> None:
        """Fill the model and the optimizer, this process's part of them, from the sharded checkpoint in
        `folder` (k3.checkpoints.dcp); `saved`: its trainer_state.pt's optimizer entry, the groups with
        their parameters' names in the single-process order."""
        from ..checkpoints.dcp import load_sharded

        names = group_names(self.model, self.optimizer)
        params = dict(self.model.named_parameters())
        states = load_sharded(
            folder, self.model, {n: params[n] for n in flat_names(names)}, no_dist=self.world_size == 1
        )
        groups = [{**g, "params": mine} for g, mine in zip(saved["param_groups"], names)]
        load_keeping_implementation(
            self.optimizer,
            lambda: self.optimizer.load_state_dict(numbered_state({"state": states, "param_groups": groups})),
        )

    # -- agreement ------------------------------------------------------------------------------------
    def on_main(self, work):
        """`work()` on the main process; its error, if any, raised on every process."""
        return work()

    def share(self, value):
        """The main process's `value` on every process (a decision only one clock should make)."""
        return value

    def gather(self, value) -> list | None:
        """Every process's `value`, in rank order, on the main process (None elsewhere)."""
        return [value]

    def any(self, flag: bool) -> bool:
        """True on every process when `flag` is true on some process."""
        return flag


def to_cpu(obj):
    """Every tensor in `obj` (nested dicts, lists, tuples) detached and on the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def compile_decoder(model: CausalLM, fullgraph: bool = False) -> None:
    """`k3 train --compile`: torch.compile the decoder in place (`nn.Module.compile`: parameter names and
    checkpoints unchanged), so that its elementwise work (SiTU, norms, gates) runs as fused kernels.
    `fullgraph`: as one graph, which the decoder is on one process (the parallel modes' hooks around
    it run collectives); evaluations run it eager (`k3.training.objective.summed_loss`), so their other
    batch shapes cost no compile.

    The first step compiles for minutes, so it pays on long runs and is off by default (its speed:
    docs/training.md). On a CPU, inductor builds C++ kernels: without a C++ compiler it cannot run, and
    this says so before any work is done."""
    if model.lm_head.weight.device.type == "cpu" and cxx_compiler() is None:
        raise ValueError(
            "--compile: torch.compile builds C++ kernels for the CPU and no C++ compiler was found "
            "(looked for $CXX, g++, c++, clang++); install one (e.g. apt install g++) or train without "
            "--compile"
        )
    model.model.compile(fullgraph=fullgraph)
