"""Settings past what a run can use are refused before any work, naming the flag and its bound: --threads
(thousands crash torch's thread pools), --time-budget (1e308 minutes overflowed the plan); and a time-budget
plan stays a finite step count whatever the clock says."""

from __future__ import annotations

import re

import pytest

from k3.training import TrainConfig
from k3.training.budget import MAX_PLANNED_STEPS, _steps_in_budget
from k3.training.config import MAX_TIME_BUDGET, max_threads, saved_train_config

from ..commands import fails


def test_the_thread_bound_is_eight_a_core_between_64_and_1024():
    assert 64 <= max_threads() <= 1024
    TrainConfig(threads=max_threads())
    with pytest.raises(ValueError, match=re.escape(f"`threads` must be an integer in [1, {max_threads()}]")):
        TrainConfig(threads=max_threads() + 1)


def test_a_checkpoint_of_a_bigger_machine_resumes_on_all_cores_here():
    assert saved_train_config({"threads": 10**5}).threads is None
    assert saved_train_config({"threads": 2}).threads == 2


@pytest.mark.parametrize("budget", ["1e308", str(MAX_TIME_BUDGET + 1), "inf"])
def test_a_time_budget_past_a_year_is_refused_before_any_work(capsys, tmp_path, budget):
    fails(
        capsys,
        ["train", "--data", str(tmp_path / "never read"), "--out", str(tmp_path / "o"), "--time-budget", budget],
        f"--time-budget: expected minutes, a finite number > 0 and <= {MAX_TIME_BUDGET}, got '{budget}'",
    )
    assert not (tmp_path / "o").exists()
    with pytest.raises(ValueError, match="`time_budget` must be a finite number of minutes > 0 and <= "):
        TrainConfig(time_budget=1e308)


def test_the_plan_of_a_budget_is_a_finite_step_count_whatever_the_clock_says():
    cfg = TrainConfig(time_budget=float(MAX_TIME_BUDGET))
    assert _steps_in_budget(cfg, 5, 1.0, 1e-300) == 5 + MAX_PLANNED_STEPS  # (inf before the bound)
    assert _steps_in_budget(cfg, 5, 1.0, 0.0) == 5 + MAX_PLANNED_STEPS  # a step the clock did not see
    late = TrainConfig(time_budget=1.0)
    assert _steps_in_budget(late, 5, 120.0, 0.0) == 6  # over time already: one more step
