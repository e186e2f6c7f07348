"""The training step and the validation measure as free functions, the same on one process and on many
(torchtitan's `train_step`): what differs between them is asked of a `ParallelDims`
(k3.training.parallel): this process's share of the batch, and the sums and maxima over processes.

`train_step` is one optimizer step (Muon and AdamW, or AdamW) on the batch's mean next-token loss with
clipped gradients, then QK-Clip and the aux-loss-free MoE bias update from the step's expert loads.
With `grad_accum` N the batch is N micro-batches whose gradients add up before the one optimizer step:
each micro-batch's mean loss is divided by N (every micro-batch has the same number of tokens, so the
sum is the mean over the whole batch), their expert loads are summed, and the MoE bias update, the
clipping and the step happen once. With `precision` "bf16" the forward passes run under torch.autocast
in bfloat16 over the float32 weights; the backward, the optimizer states and the update stay float32.
With QK-Clip on (`qk_clip`, by default with Muon) the attention layers record their heads' largest
logits in the step's forwards and, after the optimizer step, the heads above tau are scaled down
(k3.training.qk_clip), by the largest logit over processes so that every process scales alike.

On many processes every rank draws the same global batch and takes an equal contiguous slice of it;
the mean of the ranks' losses is the global batch's loss and the mean of their gradients its gradient.
The gradients are averaged by FSDP2, which every torchrun mode is (k3.training.parallel: its
reduce-scatter, or its all-reduce over replicated parameters); the step sums the
loss and the expert loads over processes, drops the gradient of an expert no process's tokens chose
(as one process leaves it without one), and with the experts split over processes clips by the norm
that adds the experts' squares over their group (torchtitan's clipping with expert parallelism).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from . import qk_clip
from .config import TrainConfig, qk_clip_threshold
from .objective import next_token_loss, per_byte, summed_loss
from .parallel import ParallelDims, held_expert_parameters


class NonFiniteLossError(FloatingPointError):
    """Training met a NaN or infinite loss or gradient norm; the run stops without saving it."""


@dataclass
class StepResult:
    """What one training step measured, for the log."""

    loss: float  # the global batch's mean loss
    grad_norm: float | None  # the gradients' total norm before clipping
    max_logit: float | None = None  # the largest attention logit (QK-Clip on)
    qk_clipped_heads: int | None = None  # the heads QK-Clip scaled down after the step


def autocast(device: torch.device, precision: str):
    """The context the forward passes run in: bfloat16 autocast with `precision` "bf16", else none."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    windows: torch.Tensor,
    cfg: TrainConfig,
    dims: ParallelDims | None = None,
    net: nn.Module | None = None,
    targets: torch.Tensor | None = None,
) -> StepResult:
    """One step of `optimizer` on `model` (a CausalLM) and the global batch `windows` [B, T + 1], taken as
    `cfg.grad_accum` equal micro-batches in `cfg.precision` (see the module). `dims`: the processes
    (None: this one alone, on the model's device); `net`: the module to call, if not `model` (a caller's
    own wrapper: one with `no_sync`, as DistributedDataParallel, skips it before the last micro-batch).
    A non-finite loss or gradient norm raises NonFiniteLossError before the weights change (on every
    process alike: both are global).

    `targets` [B, T]: instead of the next-token loss of `windows`, the cross-entropy of `windows` [B, T] (the
    inputs) against `targets`, the mean over the positions whose target is not IGNORE_INDEX (a task scored at
    some positions only, e.g. k3 lab's recall queries): `model(windows, targets=targets)`."""
    if dims is None:
        dims = ParallelDims(device=next(model.parameters()).device)
    net = model if net is None else net
    parts = windows.chunk(cfg.grad_accum)
    aims = [None] * len(parts) if targets is None else targets.chunk(cfg.grad_accum)
    if len(parts) != cfg.grad_accum or windows.shape[0] % cfg.grad_accum:
        raise ValueError(
            f"a batch of {windows.shape[0]} windows does not split into grad_accum = "
            f"{cfg.grad_accum} equal micro-batches"
        )
    model.check_tokens(windows, targets)  # once per step, here: the forwards read nothing back
    optimizer.zero_grad(set_to_none=True)
    tau = qk_clip_threshold(cfg)
    attention = qk_clip.begin_step(model, tau)
    moes = model.moe_layers()
    global_loss, loads = 0.0, [0] * len(moes)
    for i, (part, aim) in enumerate(zip(parts, aims)):
        last = i == len(parts) - 1
        with net.no_sync() if hasattr(net, "no_sync") and not last else contextlib.nullcontext():
            with autocast(dims.device, cfg.precision):
                if aim is None:
                    loss = next_token_loss(net, dims.local_batch(part))
                else:
                    loss = net(dims.local_batch(part), targets=dims.local_batch(aim))
            (loss / len(parts)).backward()
        part_loss, part_loads = _summed(loss.detach(), moes, dims)
        global_loss += part_loss / len(parts)
        loads = [total + load for total, load in zip(loads, part_loads)]
    if not math.isfinite(global_loss):
        raise NonFiniteLossError(f"the training loss is {global_loss}")
    _drop_unchosen_experts(moes, loads)
    norm = clip_gradients(model, cfg.grad_clip, dims)
    if not math.isfinite(norm):
        raise NonFiniteLossError(f"the gradient norm is {norm} (the loss is {global_loss:.4f})")
    optimizer.step()
    result = StepResult(global_loss, norm)
    if tau > 0:
        result.max_logit, result.qk_clipped_heads = qk_clip.clip(attention, tau, dims.max)
    for moe, load in zip(moes, loads):
        moe.update_bias(load, rate=cfg.moe_bias_rate)
    return result


def training_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    windows: torch.Tensor,
    cfg: TrainConfig,
    targets: torch.Tensor | None = None,
) -> float:
    """`train_step` on one process, with a model and optimizer of the caller's, on the model's device;
    returns the batch's loss (`targets`: `train_step`'s)."""
    return train_step(model, optimizer, windows, cfg, targets=targets).loss


def _summed(loss: torch.Tensor, moes: list, dims: ParallelDims) -> tuple[float, list[torch.Tensor]]:
    """The global micro-batch's mean loss and each MoE layer's expert load [E] summed over processes
    (one all-reduce for all of them)."""
    if dims.world == 1:
        return loss.item(), [moe.last_load for moe in moes]
    stats = dims.sum(torch.cat([loss.double().view(1)] + [m.last_load.double() for m in moes]))
    return stats[0].item() / dims.world, list(stats[1:].split([m.last_load.numel() for m in moes]))


def _drop_unchosen_experts(moes: list, loads: list[torch.Tensor]) -> None:
    """An expert that no process's tokens chose this step loses its gradient (a wrapper may have left
    zeros there), as one process leaves it without one: the optimizer then skips it."""
    for moe, load in zip(moes, loads):
        for e in torch.nonzero(load == 0).flatten().tolist():
            if moe.experts[e] is not None:  # (None: held by another process)
                for p in moe.experts[e].parameters():
                    p.grad = None


def _whole(norm: torch.Tensor) -> torch.Tensor:
    """A norm as a plain tensor (fsdp's is a replicated DTensor)."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def clip_gradients(model: nn.Module, max_norm: float, dims: ParallelDims) -> float:
    """Scale the gradients to a total norm of at most `max_norm`; returns the norm before clipping.
    With the experts split over processes, each rank of an expert group holds other experts: the norm
    adds the dense part's square (the same on every rank) to the experts' squares summed over the group,
    and each part (its own mesh) is scaled apart."""
    if not dims.experts_split:  # one process, ddp (the same gradients everywhere), fsdp (DTensors know)
        return float(_whole(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
    import torch.distributed as dist

    held = {id(p) for p in held_expert_parameters(model)}
    params = [p for p in model.parameters() if p.grad is not None]
    experts = [p for p in params if id(p) in held]
    dense = [p for p in params if id(p) not in held]
    squares = []  # each part's squared norm, added in float64 (the gradients' float32 or float64 rounds it after)
    for part in (dense, experts):
        norm = _whole(torch.nn.utils.get_total_norm([p.grad for p in part])) if part else torch.zeros(())
        squares.append((norm.to(dims.device, torch.float64) ** 2).reshape(1).clone())
    dist.all_reduce(squares[1], group=dims.expert_group)
    norm = (squares[0] + squares[1])[0].sqrt().to(params[0].grad.dtype)
    for part in (dense, experts):
        if part:
            torch.nn.utils.clip_grads_with_norm_(part, max_norm, norm)
    return float(norm)


def evaluate(model: nn.Module, data, windows: torch.Tensor, dims: ParallelDims, precision: str = "fp32") -> float:
    """Validation bits per byte of `model` over `windows` [n, T + 1] (k3.training.data.TokenData `data`),
    all processes together: each runs its share and the sums of loss and bytes are added up."""
    mine, counted = dims.local_windows(windows)
    with autocast(dims.device, precision):
        nats, nbytes = summed_loss(model, data, mine, counted=counted, device=dims.device)
    if dims.world == 1:
        return per_byte(nats, nbytes)
    totals = dims.sum(torch.tensor([nats, nbytes], dtype=torch.float64, device=dims.device))
    return per_byte(totals[0].item(), totals[1].item())
