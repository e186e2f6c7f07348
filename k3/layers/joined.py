"""Copies of weights laid out for the decode step: several projections of one input as one matmul, and
(k3.layers.moe) the routed experts stacked.

A decode step multiplies one token's vector by many small matrices that read the same input (KDA's q, k,
v, beta, forget-gate and output-gate projections; MLA's query, latent and gate projections; the MoE's
latent down-projection and shared expert): each matmul of one row costs more in dispatch (eager) or in a
call into the GEMM library (compiled) than in arithmetic. Joined, they are one:

    [y_1 | ... | y_n] = x [W_1; ...; W_n]^T

The copies are made by `k3.models.decode_step.prepare` when a `DecodeStep` is made (every `generate(...,
compile=True)` call makes one: the copies are those weights as they are then) and read only while a step
runs (`decoding()`). Anywhere else, training or eager `model(ids, cache=cache)`, each projection runs as
it is: a copy kept across calls could not tell reliably that its weights changed since (FSDP refills its
unsharded parameters in place, and `p.data.copy_` bumps no version counter).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

PREFIX = "_joined_"
_decoding = False  # a plain global: dynamo reads (and guards on) it while it traces the step


@contextlib.contextmanager
def decoding():
    """Inside: the layers read their prepared copies (a decode step runs)."""
    global _decoding
    before, _decoding = _decoding, True
    try:
        yield
    finally:
        _decoding = before


def in_decode_step() -> bool:
    """Whether a decode step runs, so the prepared copies are the weights to read."""
    return _decoding


def joined_linear(owner: nn.Module, name: str, linears: list[nn.Linear], x: torch.Tensor) -> list[torch.Tensor]:
    """[linear(x) for linear in linears] (no biases): inside a decode step one matmul by the joined copy
    `prepare_joined` made, elsewhere each projection as it is."""
    joined = getattr(owner, PREFIX + name, None) if in_decode_step() else None
    if joined is None:
        return [linear(x) for linear in linears]
    return list(F.linear(x, joined).split([linear.weight.shape[0] for linear in linears], dim=-1))


@torch.no_grad()
def prepare_joined(owner: nn.Module, name: str, linears: list[nn.Linear]) -> None:
    """Make the joined copy of `linears`' weights (rows one after the other) on `owner`, for decode steps."""
    if len(linears) > 1:
        setattr(owner, PREFIX + name, torch.cat([linear.weight.detach() for linear in linears]))
