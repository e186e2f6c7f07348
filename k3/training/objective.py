"""What training minimises and how validation measures it: the next-token cross-entropy, and bits
per byte, the summed loss in bits over the bytes the predicted tokens stand for (a figure that does
not depend on the tokenizer, so byte and BPE runs compare).

The LM head and the cross-entropy run in pieces of tokens, never holding the [B·T, vocab] logits
whole (`k3.models.loss.head_cross_entropy`, reached through `CausalLM.forward(..., targets=...)`).

The training step that minimises the loss is `train_step` (k3.training.step).
"""

from __future__ import annotations

import math

import torch

from ..models import CausalLM
from ..models.loss import IGNORE_INDEX
from .data import TokenData


def next_token_loss(model: CausalLM, windows: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting windows[:, 1:] from windows[:, :-1] ([B, T + 1] token ids).
    `model` is a CausalLM or a wrapper that passes keywords through (DDP); the head and the loss run in
    pieces (`CausalLM.forward` with `targets`)."""
    return model(windows[:, :-1], targets=windows[:, 1:])


@torch.no_grad()
def summed_loss(
    model: CausalLM,
    data: TokenData,
    windows: torch.Tensor,
    batch_size: int = 16,
    counted: torch.Tensor | None = None,
    device: torch.device | None = None,
) -> tuple[float, int]:
    """(next-token loss summed over `windows` [n, T + 1] in nats, bytes the predicted tokens stand for),
    evaluated `batch_size` windows at a time on `device`. `counted` [n] (bool): only those windows
    count; the others are still run (a process of a sharded model makes the calls the others make)."""
    counted = torch.ones(windows.shape[0], dtype=torch.bool) if counted is None else counted
    was_training = model.training
    model.eval()
    nats, nbytes = 0.0, 0
    # no gradient; a decoder compiled for training runs eager here (its evaluation batches, of other shapes,
    # would each compile anew for minutes)
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        for w, keep in zip(windows.split(batch_size), counted.split(batch_size)):
            targets = w[:, 1:].masked_fill(~keep[:, None], IGNORE_INDEX)  # the windows that do not count: ignored
            nats += model(w[:, :-1].to(device), targets=targets.to(device), reduction="sum").item()
            nbytes += int(data.token_bytes[w[keep, 1:]].sum())
    model.train(was_training)
    return nats, nbytes


def per_byte(nats: float, nbytes: float) -> float:
    """Bits per byte from a summed loss in nats and a byte count."""
    return nats / math.log(2) / max(1, nbytes)


def bits_per_byte(model: CausalLM, data: TokenData, windows: torch.Tensor, batch_size: int = 16) -> float:
    """Summed next-token loss in bits over the bytes the predicted tokens stand for."""
    return per_byte(*summed_loss(model, data, windows, batch_size))
