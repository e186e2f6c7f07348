"""Several projections of one input as one matmul, for decoding: their weights joined by rows once per
weight version.

A decode step multiplies one token's vector by many small matrices that read the same input (KDA's q, k,
v, beta, forget-gate and output-gate projections; the MoE's latent down-projection and shared expert):
each matmul of one row costs more in dispatch (eager) or in a call into the GEMM library (compiled) than
in arithmetic. Joined, they are one:

    [y_1 | ... | y_n] = x [W_1; ...; W_n]^T

`joined_linear(owner, name, linears, x)` keeps the joined copy on `owner` (attribute `name`), rebuilt when
any weight was replaced or written in place since (its data pointer or version changed: an optimizer
step, load_state_dict), and returns the n outputs. Inference only: with a gradient to take, each
projection runs as it is (the copy has no gradient; joining them with autograd, a cat of the weights
each step, measured within 1% of separate ones on kimi-k3-tiny's training step). While a step is being compiled the copy is read as
it is (`prepare_joined` builds it first: dynamo cannot trace the version check).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PREFIX = "_joined_"


def joined_linear(owner: nn.Module, name: str, linears: list[nn.Linear], x: torch.Tensor) -> list[torch.Tensor]:
    """[linear(x) for linear in linears] (no biases), as one matmul when no gradient is taken."""
    weights = [linear.weight for linear in linears]
    if len(linears) == 1 or (torch.is_grad_enabled() and any(w.requires_grad for w in weights)):
        return [linear(x) for linear in linears]
    joined = _joined(owner, name, weights)
    return list(F.linear(x, joined).split([w.shape[0] for w in weights], dim=-1))


def prepare_joined(owner: nn.Module, name: str, linears: list[nn.Linear]) -> None:
    """Build (or refresh) the joined copy before a step is compiled."""
    if len(linears) > 1:
        with torch.no_grad():
            _joined(owner, name, [linear.weight for linear in linears])


def _joined(owner: nn.Module, name: str, weights: list[torch.Tensor]) -> torch.Tensor:
    attribute = PREFIX + name
    cached = getattr(owner, attribute, None)
    if torch.compiler.is_compiling():
        if cached is None:
            raise RuntimeError(f"{type(owner).__name__}: its joined {name} weights were not prepared before "
                               f"compiling (k3.models.decode_step.prepare)")
        return cached[1]
    key = tuple((w.data_ptr(), w._version) for w in weights)
    if cached is None or cached[0] != key:
        with torch.no_grad():
            cached = (key, torch.cat([w.detach() for w in weights]))
        setattr(owner, attribute, cached)
    return cached[1]
