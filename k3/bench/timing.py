"""Wall-clock timing helpers for benchmarks."""

from __future__ import annotations

import time
from typing import Callable

import torch


def best_time(fn: Callable[[], object], repeats: int = 3, warmup: int = 1) -> float:
    """Fastest of `repeats` runs after `warmup` runs, in seconds (the minimum is the least noisy
    estimate on a shared machine)."""
    with torch.no_grad():
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return min(times)


def matmul_gflops(n: int = 1024, batch: int | None = None, size: int = 64, repeats: int = 5) -> float:
    """Measured float32 matmul throughput: one n x n x n GEMM, or `batch` size^3 GEMMs when given."""
    if batch is None:
        a, b = torch.randn(n, n), torch.randn(n, n)
        flops = 2 * n**3
    else:
        a, b = torch.randn(batch, size, size), torch.randn(batch, size, size)
        flops = 2 * batch * size**3
    return flops / best_time(lambda: a @ b, repeats=repeats) / 1e9
