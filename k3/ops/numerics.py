"""The delta family's floating-point safeguards, explained once: clamped gates, flushed tiny values.

Gates g are log decays (alpha = exp(g) <= 1). These bounds keep the chunk form finite and fast:

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

- FACTOR_EXP_LIMIT: no decay factor exceeds 1 while every exponent is a difference G_r - G_i of
  cumulative log gates with i <= r, so nothing can overflow whatever the gates are. KDA's diagonal
  blocks are built that way by halving them down to single tokens (`k3.ops.gates.ChannelGate`). When
  the caller states a lower bound on every step's g (`lower_bound`: Kimi K3's safe gate, -5), a block
  of b tokens is instead factored whole around its middle p, exp(G_r - G_i) = exp(G_r - G_p) exp(G_p - G_i),
  with factors within exp(+-(b/2)|lower_bound|); the halving stops at the largest b that keeps this
  within the limit. exp(40) ~ 2e17 leaves float32 ~1e21 of room for the values and gradients it
  multiplies, and exp(-40) ~ 4e-18 times those stays far from the subnormals. Without a stated bound,
  gates on the CPU in an eager forward state their own (`halving_bound`: the smallest step read from
  host memory, which stalls nothing); elsewhere (a GPU stream, a compiled graph) nothing is read back
  and the blocks halve down to single tokens.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

LOG_DECAY_FLOOR = {torch.float32: -110.0, torch.float64: -800.0}
DECAY_FLUSH = {torch.float32: -24.0, torch.float64: -300.0}  # log of the smallest decay factor kept
UT_FLUSH = {torch.float32: 2.0**-40, torch.float64: 2.0**-100}
FACTOR_EXP_LIMIT = {torch.float32: 40.0, torch.float64: 300.0}  # the largest |exponent| of a factor above 1


def log_decay_floor(dtype: torch.dtype, lower_bound: float | None = None) -> float:
    """Where a per-step g is clamped from below: LOG_DECAY_FLOOR of `dtype`, or the caller's stated
    `lower_bound` when that is higher (a g below it is taken as it)."""
    floor = LOG_DECAY_FLOOR[dtype]
    return floor if lower_bound is None else max(floor, lower_bound)


def halving_bound(g: torch.Tensor, lower_bound: float | None) -> float | None:
    """The bound on every step's g that KDA's gate halves its blocks by (`ChannelGate`): the stated
    `lower_bound`, else, for per-channel gates g [..., K > 1] in host memory outside a compiled graph,
    the smallest step itself (every g is at least it, exactly as if it had been stated; a gate in
    [-0.5, 0] factors its sub-chunks whole). Reading a CPU tensor waits on no device, so the forward
    still never stalls a GPU stream and still compiles whole (a compiled graph takes the halving
    without a bound); None elsewhere."""
    if lower_bound is not None or g.shape[-1] == 1 or g.numel() == 0:
        return lower_bound
    if g.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    return min(g.detach().min().item(), 0.0)


def decay_exp(x: torch.Tensor, floor: float | None = None) -> torch.Tensor:
    """exp(x), flushed to exactly 0 where x <= floor (default: DECAY_FLUSH of x's dtype)."""
    floor = DECAY_FLUSH[x.dtype] if floor is None else floor
    # clamped first: torch's CPU exp takes a slow path (5-35x) for -inf and for results that underflow
    return F.threshold(torch.exp(x.clamp(min=floor - 1.0)), math.exp(floor), 0.0)


def flush_tiny(x: torch.Tensor) -> torch.Tensor:
    """x with entries of magnitude below UT_FLUSH set to 0 (x dimensionless, relative to an identity)."""
    return F.hardshrink(x, UT_FLUSH[x.dtype])
