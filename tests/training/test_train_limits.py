"""Settings past what a run can use are refused before any work, naming the flag and its bound: --threads
(thousands crash torch's thread pools), --time-budget (1e308 minutes overflowed the plan), a --warmup longer
than the run (its learning rate would never reach --lr); a time-budget plan stays a finite step count
whatever the clock says, and warns of a warm-up longer than the steps it holds."""

from __future__ import annotations

import re

import pytest

from k3.training import TrainConfig
from k3.training.budget import MAX_PLANNED_STEPS, _steps_in_budget, _warmup_words
from k3.training.config import MAX_TIME_BUDGET, max_threads, saved_train_config
from k3.training.resume import _resume_overrides

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


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--max-steps", "1", "--warmup", "1000000"], "--warmup 1000000 is longer than the run's --max-steps 1"),
        (["--warmup", "1001"], "--warmup 1001 is longer than the run's 1000 steps (--max-steps' default)"),
    ],
)
def test_a_warmup_longer_than_the_run_is_refused_naming_both_flags(capsys, tmp_path, flags, expected):
    out = tmp_path / "o"
    fails(capsys, ["train", "--data", str(tmp_path / "never read"), "--out", str(out), *flags], expected, "--lr")
    assert not out.exists()


def test_train_config_refuses_a_warmup_longer_than_its_steps():
    with pytest.raises(ValueError, match="`warmup_steps` 1000000000000 is more than `max_steps` 2"):
        TrainConfig(warmup_steps=10**12, max_steps=2)
    TrainConfig(warmup_steps=2, max_steps=2)  # (reaches lr at the last step)
    TrainConfig(warmup_steps=10**6, time_budget=1.0)  # (checked once the budget's steps are known)


def test_a_resume_shorter_than_its_warmup_is_refused():
    saved = TrainConfig(max_steps=10, warmup_steps=8)
    with pytest.raises(ValueError, match=re.escape("--max-steps 5: the checkpoint's run warms up over 8 steps")):
        _resume_overrides(TrainConfig(max_steps=5), saved, ("max_steps",))
    assert _resume_overrides(TrainConfig(max_steps=8), saved, ("max_steps",))["max_steps"] == 8


def test_a_time_budget_that_holds_fewer_steps_than_the_warmup_is_warned_of():
    cfg = TrainConfig(time_budget=1.0, warmup_steps=1000, lr=1e-3)
    assert _warmup_words(cfg, 100) == (
        "\nk3 train: warning: --warmup 1000 is longer than the 100 steps that fit in --time-budget 1: the "
        "learning rate stays below --lr 0.001 for the whole run (at most 0.0001)"
    )
    assert _warmup_words(cfg, 1000) == "" and _warmup_words(TrainConfig(time_budget=1.0), 3) == ""


def test_a_seq_len_past_the_learned_positions_is_refused_before_any_work(capsys, tmp_path):
    out = tmp_path / "o"
    argv = ["train", "--preset", "gpt2-tiny", "--data", str(tmp_path / "never read"), "--out", str(out)]
    fails(
        capsys,
        [*argv, "--seq-len", "2048"],
        "--seq-len 2048: 'gpt2-tiny' has learned positions for 1024 tokens; give --seq-len at most 1024, or more "
        "positions (--set max_position_embeddings=2048)",
    )
    assert not out.exists()
