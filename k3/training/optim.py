"""The optimizer and its schedule: AdamW with weight decay on the matrices only, and the learning
rate of each step (linear warmup, then cosine or WSD).

Which parameters are exempt from weight decay is decided here, by name and shape, in one place: the
layers do not mark their parameters. Norm weights, biases, the gates' decay parameters `A_log` and
`dt_bias` (they set the time scales over which the linear-attention state forgets) and the Block
AttnRes queries are not decayed.
"""

from __future__ import annotations

import math

import torch

from .config import TrainConfig


def learning_rate(cfg: TrainConfig, step: int, total: int) -> float:
    """Linear warmup to cfg.lr, then cosine to min_lr_ratio * lr, or constant then a linear decay
    over the last wsd_decay_fraction of the steps (WSD)."""
    low = cfg.lr * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "cosine":
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
        return low + 0.5 * (cfg.lr - low) * (1 + math.cos(math.pi * progress))
    decay_start = total - int(cfg.wsd_decay_fraction * total)
    if step < decay_start:
        return cfg.lr
    return cfg.lr - (cfg.lr - low) * (step - decay_start + 1) / max(1, total - decay_start)


def no_decay(name: str, param: torch.Tensor) -> bool:
    """Norm weights, biases, the decay parameters and the AttnRes queries are not decayed."""
    return (param.dim() < 2 or name.endswith(("A_log", "dt_bias")) or "_res." in name
            or name.endswith(".bias") or "norm" in name)


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over `model`'s parameters in two groups: decayed (cfg.weight_decay), then exempt (0)."""
    decay, keep = [], []
    for name, p in model.named_parameters():
        (keep if no_decay(name, p) else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": keep, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas)
