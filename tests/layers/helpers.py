"""Shared checks for the layer tests."""

from __future__ import annotations

import torch


def prefill_then_decode_error(layer, cache, x: torch.Tensor, prefix: int) -> float:
    """Relative error between one full forward of x [B, T, d] and a prefill of `prefix` tokens followed
    by token-by-token decoding through `cache`."""
    with torch.no_grad():
        full = layer(x)
        parts = [run(layer, x[:, :prefix], cache)]
        parts += [run(layer, x[:, t : t + 1], cache) for t in range(prefix, x.shape[1])]
    got = torch.cat(parts, dim=1)
    return ((got - full).norm() / full.norm()).item()


def run(layer, x: torch.Tensor, cache, **kwargs) -> torch.Tensor:
    """layer(x, cache) as a model runs it: room made before, the cache's positions advanced after."""
    cache.owner.check_room(x.shape[1])
    y = layer(x, cache=cache, **kwargs)
    cache.owner.advance(x.shape[1])
    return y
