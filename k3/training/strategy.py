"""How a run is spread over processes, behind one small interface that `train` asks: `SingleProcess`
here, and its subclass for the torchrun modes, `Distributed` (k3.training.distributed), which keeps
this class's step and evaluation and changes only their hooks (the methods whose docstrings begin
"Hook:"), besides how the data, the model, checkpoints and agreement reach the processes.

A strategy prepares the data (`prepare`), splits the model and builds its optimizer (`setup`), takes
one optimizer step on the global batch (`step`), measures validation bits per byte over all
processes (`evaluate`), saves and resumes checkpoints (`save`, `load_optimizer`, `load_sharded`), and
lets the processes agree (`share`, `any`, `is_main`, `close`).

`SingleProcess.step` is the training step: AdamW on the batch's mean next-token loss with clipped
gradients, then the aux-loss-free MoE bias update from the step's expert loads. With `grad_accum` N
the batch is N micro-batches whose gradients add up before the one optimizer step: each micro-batch's
mean loss is divided by N (every micro-batch has the same number of tokens, so the sum is the mean
over the whole batch), their expert loads are summed, and the MoE bias update, the clipping and the
step happen once. With `precision` "bf16" the forward passes run under torch.autocast in bfloat16
over the float32 weights; the backward, the AdamW states and the update stay float32. With QK-Clip
on (`qk_clip`, by default with Muon) the attention layers record their heads' largest logits in the
step's forwards and, after the optimizer step, the heads above tau are scaled down (k3.training.qk_clip).

The hooks are which slice of the batch this process takes (`local_batch`, `local_windows`), how the
loss, the expert loads and the validation sums are summed over processes (`sum_over_processes`,
`sum_totals`), and how gradients are synchronised and clipped (`accumulating`,
`synchronize_gradients`, `clip_gradients`), and how the heads' largest logits are taken over processes
(`max_over_processes`).
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from ..models import CausalLM
from ..runtime import cxx_compiler, resolve_device
from ..tokenizer import Tokenizer
from .checkpoint import save_training_checkpoint
from . import qk_clip
from .config import TrainConfig, qk_clip_threshold
from .data import TokenData, prepare
from .objective import next_token_loss, per_byte, summed_loss
from .optim import build_optimizer, flat_names, group_names, load_keeping_implementation, numbered_state
from .parallel import apply_recompute


class NonFiniteLossError(FloatingPointError):
    """Training met a NaN or infinite loss or gradient norm; the run stops without saving it."""


def _value(norm: torch.Tensor) -> float:
    """A gradient norm as a float (fsdp's is a replicated DTensor)."""
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


class SingleProcess:
    """A run on this process alone, on one device (`device`: "auto" picks CUDA, then MPS, then the
    CPU); no torch.distributed."""

    is_main = True  # the process that logs and writes
    rank, world_size = 0, 1

    def __init__(self, device: str = "auto"):
        self.device = resolve_device(device)
        self.model: CausalLM | None = None  # the model, as the single process sees it
        self.net: nn.Module | None = None  # the module to call in training (a wrapper, or `model`)
        self.optimizer: torch.optim.Optimizer | None = None
        self.precision = "fp32"
        self.grad_norm: float | None = None  # the last step's gradient norm before clipping
        self.max_logit: float | None = None  # the last step's largest attention logit (QK-Clip on)
        self.qk_clipped_heads: int | None = None  # ... and the heads QK-Clip scaled down after it

    def describe(self) -> str:
        """How the run is split, for the opening message ("" on one process)."""
        return ""

    def close(self) -> None:
        """Release what the strategy holds (a process group)."""

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
        model.to(self.device)
        apply_recompute(model, cfg.recompute)
        if cfg.compile:
            compile_decoder(model)
        self.model = self.net = model
        self.optimizer = build_optimizer(model, cfg)
        self.precision = cfg.precision

    def autocast(self):
        """The context the forward passes run in: bfloat16 autocast with `precision` "bf16", else none."""
        if self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # -- the training step ----------------------------------------------------------------------------
    def step(self, windows: torch.Tensor, cfg: TrainConfig, targets: torch.Tensor | None = None) -> float:
        """One optimizer step (Muon and AdamW, or AdamW: `cfg.optimizer`) on the global batch `windows`
        [B, T + 1] (clipped gradients), taken as `cfg.grad_accum` equal micro-batches, then QK-Clip and the MoE
        bias update. Returns the batch's loss. A non-finite loss or gradient norm raises NonFiniteLossError
        before the weights change (on every process alike: both are global).

        `targets` [B, T]: the loss is not the next-token loss of windows but the cross-entropy of `windows`
        [B, T] (the inputs) against `targets`, the mean over the positions whose target is not IGNORE_INDEX (a
        task scored at some positions only, e.g. k3 lab's recall queries): CausalLM(windows, targets=targets)."""
        parts = windows.chunk(cfg.grad_accum)
        aims = [None] * len(parts) if targets is None else targets.chunk(cfg.grad_accum)
        if len(parts) != cfg.grad_accum or windows.shape[0] % cfg.grad_accum:
            raise ValueError(f"a batch of {windows.shape[0]} windows does not split into grad_accum = "
                             f"{cfg.grad_accum} equal micro-batches")
        self.optimizer.zero_grad(set_to_none=True)
        tau = qk_clip_threshold(cfg)
        attention = qk_clip.begin_step(self.model, tau)
        moes = self.model.moe_layers()
        global_loss, loads = 0.0, [0] * len(moes)
        for i, (part, aim) in enumerate(zip(parts, aims)):
            with self.accumulating(last=i == len(parts) - 1):
                with self.autocast():
                    if aim is None:
                        loss = next_token_loss(self.net, self.local_batch(part))
                    else:
                        loss = self.net(self.local_batch(part), targets=self.local_batch(aim))
                (loss / len(parts)).backward()
            part_loss, part_loads = self.sum_over_processes(loss.detach(), moes)
            global_loss += part_loss / len(parts)
            loads = [total + load for total, load in zip(loads, part_loads)]
        if not math.isfinite(global_loss):
            raise NonFiniteLossError(f"the training loss is {global_loss}")
        self.synchronize_gradients(loads)
        norm = self.clip_gradients(cfg.grad_clip)
        self.grad_norm = None if norm is None else _value(norm)
        if norm is not None and not math.isfinite(self.grad_norm):
            raise NonFiniteLossError(f"the gradient norm is {self.grad_norm} (the loss is {global_loss:.4f})")
        self.optimizer.step()
        if tau > 0:
            self.max_logit, self.qk_clipped_heads = qk_clip.clip(attention, tau, self.max_over_processes)
        for moe, load in zip(moes, loads):
            moe.update_bias(load, rate=cfg.moe_bias_rate)
        return global_loss

    def local_batch(self, windows: torch.Tensor) -> torch.Tensor:
        """Hook: this process's share of the global batch (a micro-batch of it), on its device."""
        return windows.to(self.device)

    def accumulating(self, last: bool):
        """Hook: the context of one micro-batch's forward and backward (`last`: the step's last one)."""
        return contextlib.nullcontext()

    def sum_over_processes(self, loss: torch.Tensor, moes: list) -> tuple[float, list[torch.Tensor]]:
        """Hook: the global batch's loss and each MoE layer's expert load [E] summed over processes."""
        return loss.item(), [moe.last_load for moe in moes]

    def synchronize_gradients(self, loads: list[torch.Tensor]) -> None:
        """Hook: make the gradients the global batch's (given the summed expert loads)."""

    def clip_gradients(self, max_norm: float) -> torch.Tensor | None:
        """Hook: scale the gradients to a total norm of at most `max_norm`; returns the norm before
        clipping (None: not known here)."""
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def max_over_processes(self, values: torch.Tensor) -> torch.Tensor:
        """Hook: `values` (every attention head's largest logit this step) maximised over processes."""
        return values

    # -- evaluation -----------------------------------------------------------------------------------
    def evaluate(self, data: TokenData, windows: torch.Tensor) -> float:
        """Validation bits per byte over `windows` [n, T + 1], all processes together."""
        mine, counted = self.local_windows(windows)
        with self.autocast():
            nats, nbytes = summed_loss(self.model, data, mine, counted=counted, device=self.device)
        return per_byte(*self.sum_totals(nats, nbytes))

    def local_windows(self, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hook: the validation windows this process runs, and which of them count (None: all)."""
        return windows, None

    def sum_totals(self, nats: float, nbytes: int) -> tuple[float, float]:
        """Hook: summed loss and byte count over processes."""
        return nats, nbytes

    # -- checkpoints ----------------------------------------------------------------------------------
    def save(self, out, tokenizer: Tokenizer, cfg: TrainConfig, step: int, max_steps: int | None,
             generator: torch.Generator, history: dict) -> None:
        """`save_training_checkpoint` of the whole model and optimizer, written by the main process."""
        weights, optimizer_state = self.full_state()
        self.on_main(lambda: save_training_checkpoint(
            out, self.model, self.optimizer, tokenizer, cfg, step, max_steps, generator, history,
            weights=weights, optimizer_state=optimizer_state))

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
        `folder` (k3.training.sharded); `saved`: its trainer_state.pt's optimizer entry, the groups with
        their parameters' names in the single-process order."""
        from .sharded import load_sharded

        names = group_names(self.model, self.optimizer)
        params = dict(self.model.named_parameters())
        states = load_sharded(folder, self.model, {n: params[n] for n in flat_names(names)},
                              no_dist=self.world_size == 1)
        groups = [{**g, "params": mine} for g, mine in zip(saved["param_groups"], names)]
        load_keeping_implementation(self.optimizer, lambda: self.optimizer.load_state_dict(
            numbered_state({"state": states, "param_groups": groups})))

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


def training_step(model: CausalLM, optimizer: torch.optim.Optimizer, windows: torch.Tensor, cfg: TrainConfig,
                  targets: torch.Tensor | None = None) -> float:
    """One step of `optimizer` (Muon and AdamW, or AdamW) on `model` and a batch of windows [B, T + 1] (clipped
    gradients), then QK-Clip and the MoE bias update: `SingleProcess.step` with a model and optimizer of the
    caller's, on the model's device, in `cfg.precision`, in `cfg.grad_accum` micro-batches. Returns the loss.
    `targets` [B, T]: `windows` [B, T] are inputs scored against them where not IGNORE_INDEX (`step`)."""
    strategy = SingleProcess("cpu")
    strategy.device = next(model.parameters()).device
    strategy.model = strategy.net = model
    strategy.optimizer = optimizer
    strategy.precision = cfg.precision
    return strategy.step(windows, cfg, targets)


def to_cpu(obj):
    """Every tensor in `obj` (nested dicts, lists, tuples) detached and on the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def compile_decoder(model: CausalLM) -> None:
    """`k3 train --compile`: torch.compile the decoder in place (`nn.Module.compile`: parameter names and
    checkpoints unchanged), so that its elementwise work (SiTU, norms, gates) runs as fused kernels.

    The first step compiles for minutes, so it pays on long runs and is off by default (its speed:
    docs/training.md). On a CPU, inductor builds C++ kernels: without a C++ compiler it cannot run, and
    this says so before any work is done."""
    if model.lm_head.weight.device.type == "cpu" and cxx_compiler() is None:
        raise ValueError("--compile: torch.compile builds C++ kernels for the CPU and no C++ compiler was found "
                         "(looked for $CXX, g++, c++, clang++); install one (e.g. apt install g++) or train without "
                         "--compile")
    model.model.compile()