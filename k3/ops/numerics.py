"""The delta family's floating-point safeguards, explained once: clamped gates, flushed tiny values.

Gates g are log decays (alpha = exp(g) <= 1). Two bounds keep the chunk form finite and fast:

- LOG_DECAY_FLOOR: a per-step g is clamped from below before it is summed over a chunk. Below it
  exp(g) is exactly 0 in the dtype anyway, so g = -inf ("clear the state") stays exact while every
  cumulative sum stays finite.

- DECAY_FLUSH and UT_FLUSH: decay factors below exp(-24) (float32) / exp(-300) (float64), and entries
  of the dimensionless UT matrix (I + A) and its inverse below 2^-40 / 2^-100, are flushed to exactly
  zero. They are far below the dtype's resolution (exp(-24) ~ 4e-11 against float32's 6e-8; 2^-40 is
  over 10^4 times below it), so the results do not change. Kept, their products with other small
  factors become subnormal numbers, which x86 CPUs handle in slow microcode: every matmul touching
  them slows down. torch.set_flush_denormal cannot help, as it reaches only the calling thread, not
  the intra-op worker threads. The thresholds are large enough that a product of a few kept values
  (two decay factors, three UT entries) is still a normal number.

No decay factor exceeds 1: every exponent is a difference G_r - G_i of cumulative log gates with i <= r
(KDA's per-channel scores included, `k3.ops.gates`), so nothing can overflow whatever the gates are.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

LOG_DECAY_FLOOR = {torch.float32: -110.0, torch.float64: -800.0}
DECAY_FLUSH = {torch.float32: -24.0, torch.float64: -300.0}  # log of the smallest decay factor kept
UT_FLUSH = {torch.float32: 2.0**-40, torch.float64: 2.0**-100}


def decay_exp(x: torch.Tensor, floor: float | None = None) -> torch.Tensor:
    """exp(x), flushed to exactly 0 where x <= floor (default: DECAY_FLUSH of x's dtype)."""
    floor = DECAY_FLUSH[x.dtype] if floor is None else floor
    # the exponent flushed first, to -inf: exp gives exactly 0 there and never a subnormal, in two passes
    return torch.exp(F.threshold(x, floor, -math.inf))


def flush_tiny(x: torch.Tensor) -> torch.Tensor:
    """x with entries of magnitude below UT_FLUSH set to 0 (x dimensionless, relative to an identity)."""
    return F.hardshrink(x, UT_FLUSH[x.dtype])
