"""A time-budget run's step count (`TrainConfig.time_budget`): the steps that fit in the minutes left,
evaluations included (`_steps_in_budget`), and the plan re-timed as the machine speeds up or slows down
(`_replan`)."""

from __future__ import annotations

import math
import sys

from .config import TrainConfig
from .optim import warmup_steps

MAX_PLANNED_STEPS = 10**12  # a plan's most steps: past them the figures stop meaning anything (and int(inf) fails)


def _replan(cfg: TrainConfig, step: int, elapsed: float, per_step: float, max_steps: int, bar) -> int:
    """Re-time a time-budget run every few steps from the recent steps' speed (`per_step` seconds), so
    that it ends on time and uses the budget: the first steps run slower than the rest, and a shared
    machine speeds up and slows down. Until the warm-up ends (where the learning rate does not depend on
    the schedule's length yet) the step count follows the estimate exactly; after it, it moves when the
    estimate differs by more than 3% (the schedule stretches or shrinks with it, a small change of the
    learning rate at that step). Exact resume is a property of --max-steps runs."""
    fits = _steps_in_budget(cfg, step, elapsed, per_step)
    if step + 10 <= warmup_steps(cfg, fits):  # the next replan is still inside the warm-up
        bar.total = fits
        return fits
    if abs(fits - max_steps) <= 0.03 * max_steps:
        return max_steps
    bar.total = fits
    if abs(fits - max_steps) > 0.1 * max_steps:  # said only when it is news
        what = "slowed" if fits < max_steps else "sped up"
        bar.write(
            f"k3 train: the machine {what} to {per_step:.2f} s/step; {fits} steps now fit in {cfg.time_budget:g} min",
            file=sys.stderr,
        )
    return fits


def _steps_in_budget(cfg: TrainConfig, step: int, elapsed: float, step_seconds: float) -> int:
    """Steps that fit in the time budget, counting periodic and final evaluations (a forward pass
    costs about a third of a training step per token)."""
    eval_seconds = step_seconds / 3 / (cfg.batch_size * cfg.grad_accum * cfg.seq_len)  # per validation token
    final_tokens = cfg.eval_tokens * 8 if cfg.final_eval_tokens is None else cfg.final_eval_tokens
    final = final_tokens * eval_seconds
    per_step = step_seconds + cfg.eval_tokens * eval_seconds / cfg.eval_every
    left = cfg.time_budget * 60 - elapsed - final
    # steps so fast that the clock saw none (0 s), or a budget far beyond them: at most MAX_PLANNED_STEPS
    fits = 0.97 * left / per_step if per_step > 0 else (math.inf if left > 0 else 0)
    return max(step + 1, step + int(min(fits, MAX_PLANNED_STEPS)))


def _warmup_words(cfg: TrainConfig, max_steps: int) -> str:
    """A warning when the run's --warmup is longer than the steps its time budget was found to hold (the
    learning rate never reaches --lr), else nothing."""
    if cfg.warmup_steps is None or cfg.warmup_steps <= max_steps:
        return ""
    return (
        f"\nk3 train: warning: --warmup {cfg.warmup_steps} is longer than the {max_steps} steps that fit in "
        f"--time-budget {cfg.time_budget:g}: the learning rate stays below --lr {cfg.lr:g} for the whole run "
        f"(at most {cfg.lr * max_steps / cfg.warmup_steps:.2g})"
    )
