"""Timing helpers for `k3 bench` and `k3 lab`, each with one meaning: the best of a few runs of one
callable (`best_time`) and the machine's matmul throughput (`matmul_gflops`), both defined in k3.runtime
(`k3 train` prints the latter too), several candidates timed
round after round (`interleaved_best`), a clock that reads one thread's CPU time (`thread_clock`) and
torch's thread count for the length of a block (`threads`).

The benchmarks time ratios measured side by side in one run, never absolute speeds: on a noisy shared
machine the minimum of several runs is the least noisy estimate, and interleaving the candidates puts
every one of them through the same phases of the machine.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable, Hashable

import torch

from ..io import write_json
from ..runtime import best_time, matmul_gflops  # noqa: F401 - timing's public names

WARMUPS = ("inline", "ahead")

# CPU seconds of the calling thread: when torch runs on one thread, the thread that runs every op; on a
# quiet machine the wall time, on a busy one without the moments the thread waited for a core
thread_clock = time.thread_time


def interleaved_best(
    cases: dict[Hashable, Callable[[], object]],
    rounds: int,
    *,
    warmup: str = "inline",
    cold: frozenset = frozenset(),
    grad: bool = False,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[Hashable, float]:
    """Best time (seconds of `clock`) of each case over `rounds` rounds, every round timing each case once.

    Every case but those named in `cold` (slow token loops, or cases of seconds each, which have nothing
    to warm up) gets one untimed warm-up call: with `warmup="inline"` right before its first timed call,
    in the first round; with `warmup="ahead"` all of them, in order, before the first round.
    `grad=False` runs every call, warm-ups included, under `torch.no_grad`; `grad=True` leaves autograd
    as the caller has it (a case that only infers then wraps itself in no_grad). `clock` is the wall
    clock `time.perf_counter` unless given, e.g. `thread_clock`.
    """
    if warmup not in WARMUPS:
        raise ValueError(f"interleaved_best: `warmup` must be one of {WARMUPS}, got {warmup!r}")
    best = {name: math.inf for name in cases}
    with nullcontext() if grad else torch.no_grad():
        if warmup == "ahead":
            for name, fn in cases.items():
                if name not in cold:
                    fn()
        for r in range(rounds):
            for name, fn in cases.items():
                if warmup == "inline" and r == 0 and name not in cold:
                    fn()
                start = clock()
                fn()
                best[name] = min(best[name], clock() - start)
    return best


@contextmanager
def threads(n: int):
    """Run torch ops on `n` threads inside the block (the previous count is restored)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


WRITTEN_BY = "k3 bench"  # the mark of a figures file k3 bench wrote: the only kind of file --json replaces


def check_report_target(path: str | Path) -> None:
    """FileExistsError, before a benchmark runs, when `--json PATH` names a file k3 bench did not write (a JSON
    object marked `"written_by": "k3 bench ..."`): the benchmark's figures never replace a user's file."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"--json {path}: a folder; give the path of a .json file to write")
    folder = path.parent
    if not folder.is_dir():
        raise FileNotFoundError(f"--json {path}: {folder} is no folder; give a path in an existing folder")
    try:  # the folder takes a file (the figures are written beside, then renamed): tried before any work
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise PermissionError(f"--json {path}: cannot write a file in {folder} ({e.strerror})") from None
    if not path.exists():
        return
    try:
        ours = str(json.loads(path.read_text(encoding="utf-8")).get("written_by", "")).startswith(WRITTEN_BY)
    except (ValueError, AttributeError, OSError):
        ours = False
    if not ours:
        raise FileExistsError(
            f"--json {path}: the file exists and k3 bench did not write it; give another path, or move the file away"
        )


def write_report(path: str | Path, report: dict, command: str, indent: int = 1) -> None:
    """`report` as JSON at `path` (atomically), marked as k3 bench's (`check_report_target`)."""
    check_report_target(path)
    write_json(path, {"written_by": f"{WRITTEN_BY} {command}", **report}, indent=indent)
