"""Latent MoE against a full-width MoE with the same experts and top-k: "the experts operate in a
compressed latent space, which ... nearly halves the FLOPs". FLOPs per token on paper at K3's size
(`moe_flops`), and the forward time of both at a small size with K3's proportions (`time_moe`)."""

from __future__ import annotations

import torch

from ...bench.timing import interleaved_best, thread_clock
from ...layers.moe import MoE
from .cases import forward


def moe_flops(
    dim: int, hidden: int, num_experts: int, top_k: int, latent: int | None = None, num_shared: int = 0
) -> dict[str, int]:
    """FLOPs per token of one MoE layer (a multiply-add is 2 FLOPs; elementwise work left out):

    router              2 d E                         (scores for all E experts)
    latent projections  2 (2 d L)                     (down d -> L and up L -> d; latent MoE only)
    routed experts      k * 3 * 2 e I                 (gate, up, down of the k chosen; e = L or d)
    shared experts      3 * 2 d (n_shared I)          (at full width d in both)
    """
    for name, value in (("dim", dim), ("hidden", hidden), ("num_experts", num_experts), ("top_k", top_k)):
        if value < 1:
            raise ValueError(f"moe_flops: `{name}` must be >= 1, got {value}")
    if latent is not None and latent < 1:
        raise ValueError(f"moe_flops: `latent` must be None or >= 1, got {latent}")
    width = dim if latent is None else latent
    return {
        "router": 2 * dim * num_experts,
        "latent projections": 0 if latent is None else 4 * dim * latent,
        "routed experts": top_k * 6 * width * hidden,
        "shared experts": 6 * dim * num_shared * hidden,
    }


def moe_flop_ratios(
    dim: int, hidden: int, num_experts: int, top_k: int, latent: int, num_shared: int = 0
) -> dict[str, float]:
    """Latent / full-width FLOPs per token (see `moe_flops`): the routed experts alone, the routed path
    (experts + latent projections) and the whole layer (router and shared experts too)."""
    lat = moe_flops(dim, hidden, num_experts, top_k, latent, num_shared)
    full = moe_flops(dim, hidden, num_experts, top_k, None, num_shared)
    return {
        "routed experts": lat["routed experts"] / full["routed experts"],
        "routed path": routed_flops(lat) / routed_flops(full),
        "MoE layer": sum(lat.values()) / sum(full.values()),
    }


def routed_flops(flops: dict[str, int]) -> int:
    """The routed path's FLOPs in a `moe_flops` count: the routed experts and the latent projections."""
    return flops["routed experts"] + flops["latent projections"]


def time_moe(
    tokens: int, dim: int, latent: int, hidden: int, experts: int, top_k: int, rounds: int, seed: int = 0
) -> dict[str, float]:
    """Forward seconds of a latent and a full-width MoE (same E, top-k, expert width; no shared experts,
    so only the routed path differs) on the same [tokens, dim] input, routed alike (one router's weights)."""
    torch.manual_seed(seed)
    layers = {
        "latent": MoE(dim, experts, top_k, hidden, num_shared=0, latent_dim=latent, activation="situ"),
        "full width": MoE(dim, experts, top_k, hidden, num_shared=0, latent_dim=None, activation="situ"),
    }
    layers["full width"].router.load_state_dict(layers["latent"].router.state_dict())  # the same routing
    x = torch.randn(tokens, dim, generator=torch.Generator().manual_seed(seed))
    cases = {name: forward(m, x) for name, m in layers.items()}
    return interleaved_best(cases, rounds, warmup="ahead", grad=True, clock=thread_clock)


def moe_verdict(routed_path_ratio: float) -> str:
    """From the routed path's latent / full-width FLOP ratio at K3's size (experts + the latent
    projections that the latent space costs): "nearly halves" holds at <= 0.6, partly at <= 0.8."""
    return "holds" if routed_path_ratio <= 0.6 else "partly" if routed_path_ratio <= 0.8 else "does not hold"
