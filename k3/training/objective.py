"""What training minimises and how validation measures it: the next-token cross-entropy, and bits
per byte, the summed loss in bits over the bytes the predicted tokens stand for (a figure that does
not depend on the tokenizer, so byte and BPE runs compare).

The training step that minimises the loss is `SingleProcess.step` (k3.training.strategy).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..models import CausalLM
from .data import TokenData


def next_token_loss(model: CausalLM, windows: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting windows[:, 1:] from windows[:, :-1] ([B, T + 1] token ids)."""
    logits = model(windows[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


@torch.no_grad()
def summed_loss(model: CausalLM, data: TokenData, windows: torch.Tensor, batch_size: int = 16,
                counted: torch.Tensor | None = None, device: torch.device | None = None) -> tuple[float, int]:
    """(next-token loss summed over `windows` [n, T + 1] in nats, bytes the predicted tokens stand for),
    evaluated `batch_size` windows at a time on `device`. `counted` [n] (bool): only those windows
    count; the others are still run (a process of a sharded model makes the calls the others make)."""
    counted = torch.ones(windows.shape[0], dtype=torch.bool) if counted is None else counted
    was_training = model.training
    model.eval()
    nats, nbytes = 0.0, 0
    for w, keep in zip(windows.split(batch_size), counted.split(batch_size)):
        logits = model(w[:, :-1].to(device)).float()  # [b, T, vocab]
        if not bool(keep.all()):  # (a copy of the logits: only where some windows do not count)
            logits, w = logits[keep.to(device)], w[keep]
        targets = w[:, 1:]
        nats += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).to(device),
                                reduction="sum").item()
        nbytes += int(data.token_bytes[targets].sum())
    model.train(was_training)
    return nats, nbytes


def per_byte(nats: float, nbytes: float) -> float:
    """Bits per byte from a summed loss in nats and a byte count."""
    return nats / math.log(2) / max(1, nbytes)


def bits_per_byte(model: CausalLM, data: TokenData, windows: torch.Tensor, batch_size: int = 16) -> float:
    """Summed next-token loss in bits over the bytes the predicted tokens stand for."""
    return per_byte(*summed_loss(model, data, windows, batch_size))
