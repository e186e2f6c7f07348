"""The calls `k3 lab parts` times, as closures for `k3.bench.timing.interleaved_best`: a forward pass
without gradients, and a forward + backward pass. The parts' experiments time both kinds in one
interleaved run, so they time with gradients on and each forward case turns them off itself."""

from __future__ import annotations

from typing import Callable

import torch


def forward(fn: Callable, *args) -> Callable[[], object]:
    def run():
        with torch.no_grad():
            return fn(*args)

    return run


def forward_backward(fn: Callable, *args) -> Callable[[], object]:
    def run():
        for a in args:
            a.grad = None
        fn(*args).sum().backward()

    return run
