"""Copies of weights laid out for the decode step: several projections of one input as one matmul, and
(k3.layers.moe) the routed experts stacked.

A decode step multiplies one token's vector by many small matrices that read the same input (KDA's q, k,
v, beta, forget-gate and output-gate projections; MLA's query, latent and gate projections; the MoE's
latent down-projection and shared expert): each matmul of one row costs more in dispatch (eager) or in a
call into the GEMM library (compiled) than in arithmetic. Joined, they are one:

    [y_1 | ... | y_n] = x [W_1; ...; W_n]^T

Who makes them and who reads them is explicit: `k3.inference.decode_step.prepare_for_decoding(model)` asks
each layer that has some for its copies (`fuse_for_decoding()`, made from the weights as they are then),
the `DecodeStep` that called it keeps them, and its step hands each layer its own as the `fused` argument
of `forward`. A forward given none (training, eager `model(ids, cache=cache)`) runs each projection as it
is: a copy kept across calls could not tell reliably that its weights changed since (FSDP refills its
unsharded parameters in place, and `p.data.copy_` bumps no version counter).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


@torch.no_grad()
def join(linears: list[nn.Linear]) -> torch.Tensor | None:
    """The rows of `linears`' weights one after the other, [sum out_i, in] (a copy); None for fewer than two."""
    if len(linears) < 2:
        return None
    return torch.cat([linear.weight.detach() for linear in linears])


def project(x: torch.Tensor, linears: list[nn.Linear], joined: torch.Tensor | None) -> list[torch.Tensor]:
    """[linear(x) for linear in linears] (no biases): one matmul by `joined` (what `join(linears)` made)
    when given, each projection as it is when not."""
    if joined is None:
        return [linear(x) for linear in linears]
    return list(F.linear(x, joined).split([linear.weight.shape[0] for linear in linears], dim=-1))
