"""The optimizer and its schedule: Muon on the hidden matrices and AdamW on the rest (`k3.training.muon`,
the default), or AdamW on everything; weight decay on the matrices only; the learning rate of each step
(linear warmup, then cosine or WSD).

Which parameters are exempt from weight decay is decided here, by name and shape, in one place: the
layers do not mark their parameters. Norm weights, biases, the gates' decay parameters `A_log` and
`dt_bias` (they set the time scales over which the linear-attention state forgets) and the Block
AttnRes queries are not decayed.
"""

from __future__ import annotations

import math

import torch

from .config import MAX_WARMUP_STEPS, WARMUP_FRACTION, TrainConfig
from .muon import Muon, takes_muon


def warmup_steps(cfg: TrainConfig, total: int | None) -> int:
    """The warm-up of a run of `total` steps: cfg.warmup_steps when given, else WARMUP_FRACTION of the
    steps (at least 1, at most MAX_WARMUP_STEPS), so that a short run leaves its warm-up and reaches
    WSD's decay. `total` None (a time-budget run before its step count is planned): the longest."""
    if cfg.warmup_steps is not None:
        return cfg.warmup_steps
    if total is None:
        return MAX_WARMUP_STEPS
    return max(1, min(MAX_WARMUP_STEPS, round(WARMUP_FRACTION * total)))


def learning_rate(cfg: TrainConfig, step: int, total: int | None) -> float:
    """Linear warmup to cfg.lr (`warmup_steps`), then cosine to min_lr_ratio * lr, or constant then a
    linear decay over the last wsd_decay_fraction of the steps (WSD). `total` None: the step count is
    not known yet (a time-budget run's first steps), so only the warm-up and the constant part apply."""
    low = cfg.lr * cfg.min_lr_ratio
    warmup = warmup_steps(cfg, total)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    if total is None:
        return cfg.lr
    if cfg.schedule == "cosine":
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return low + 0.5 * (cfg.lr - low) * (1 + math.cos(math.pi * progress))
    decay_start = total - int(cfg.wsd_decay_fraction * total)
    if step < decay_start:
        return cfg.lr
    return cfg.lr - (cfg.lr - low) * (step - decay_start + 1) / max(1, total - decay_start)


def no_decay(name: str, param: torch.Tensor) -> bool:
    """Norm weights, biases, the decay parameters and the AttnRes queries are not decayed."""
    return (
        param.dim() < 2
        or name.endswith(("A_log", "dt_bias"))
        or "_res." in name
        or name.endswith(".bias")
        or "norm" in name
    )


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """`model`'s parameters as two optimizer groups: decayed (`weight_decay`), then exempt (`no_decay`: 0)."""
    decay, keep = [], []
    for name, p in model.named_parameters():
        (keep if no_decay(name, p) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]


def muon_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """`model`'s parameters as three groups: the hidden matrices (Muon, decayed), then AdamW's decayed
    (the embedding table, the LM head) and exempt (`no_decay`) ones."""
    matrices, decay, keep = [], [], []
    for name, p in model.named_parameters():
        if no_decay(name, p):
            keep.append(p)
        else:
            (matrices if takes_muon(name, p) else decay).append(p)
    return [
        {"params": matrices, "weight_decay": weight_decay, "use_muon": True},
        {"params": decay, "weight_decay": weight_decay},
        {"params": keep, "weight_decay": 0.0},
    ]


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, fused: bool | None = None) -> torch.optim.Optimizer:
    """cfg.optimizer over `model`'s parameters: "muon" (`muon_groups`) or "adamw" in two groups,
    decayed (cfg.weight_decay), then exempt (0). `fused` None: torch's fused AdamW (one kernel over all
    parameters) where every parameter is a plain CPU / CUDA tensor, the default implementation where not
    (FSDP's DTensors); False: the default implementation always. The two compute the same update with
    different rounding, so a caller whose recorded results came from one (k3 lab's) keeps it."""
    groups = muon_groups(model, cfg.weight_decay) if cfg.optimizer == "muon" else decay_groups(model, cfg.weight_decay)
    params = [p for group in groups for p in group["params"]]
    if fused is None:
        fused = bool(params) and all(type(p.data) is torch.Tensor and p.device.type in ("cpu", "cuda") for p in params)
    if cfg.optimizer == "muon":
        return Muon(groups, lr=cfg.lr, betas=cfg.betas, fused=fused or None)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=fused or None)


# settings of torch's optimizers that choose an implementation (a fused kernel, foreach), not the maths
IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")


def portable_state(state: dict) -> dict:
    """An optimizer state dict without the implementation settings: what a checkpoint records, so that
    a run saved by one implementation (fused on plain tensors, the default on FSDP's shards) resumes
    under another."""
    groups = [{k: v for k, v in g.items() if k not in IMPLEMENTATION} for g in state["param_groups"]]
    return {**state, "param_groups": groups}


def load_keeping_implementation(optimizer: torch.optim.Optimizer, load) -> None:
    """Run `load()` (which loads a state dict into `optimizer`), then give the optimizer back its own
    implementation settings (a checkpoint's, or their absence, must not switch them)."""
    own = [{k: g[k] for k in IMPLEMENTATION if k in g} for g in optimizer.param_groups]
    load()
    for group, settings in zip(optimizer.param_groups, own):
        group.update(settings)


def group_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The names of each optimizer group's parameters, in the group's order."""
    name = {id(p): n for n, p in model.named_parameters()}
    return [[name[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def flat_names(groups: list[list[str]]) -> list[str]:
    """Every group's names, in order: the parameters in torch's numbering."""
    return [name for group in groups for name in group]


def named_state(state: dict, names: list[str]) -> dict:
    """An optimizer state dict in torch's numbering (parameters numbered in group order) -> keyed by
    parameter name, given the names in that order (the layout of torch.distributed.checkpoint)."""
    return {
        "state": {names[i]: s for i, s in state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
    }


def numbered_state(state: dict) -> dict:
    """The inverse of `named_state`: parameters numbered in the order the groups list them."""
    index = {name: i for i, name in enumerate(flat_names([g["params"] for g in state["param_groups"]]))}
    return {
        "state": {index[n]: s for n, s in state["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]],
    }
