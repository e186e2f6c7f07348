"""Input checks shared by the mixer layers."""

from __future__ import annotations

import torch


def check_mixer_input(layer: str, x: torch.Tensor, hidden_size: int, cache) -> None:
    """x must be [B, T, hidden_size]; a cache that already holds state must be for the same batch size."""
    if x.dim() != 3 or x.shape[-1] != hidden_size:
        raise ValueError(f"{layer}: `x` must be [B, T, {hidden_size}], got {list(x.shape)}")
    if cache is not None and cache.batch_size not in (None, x.shape[0]):
        raise ValueError(
            f"{layer}: the cache holds batch size {cache.batch_size}, `x` has batch size "
            f"{x.shape[0]}; make a new cache for this batch"
        )
