"""Many small trainings at once: `run_jobs` runs single-threaded jobs side by side in worker processes, one per
core (tiny models run fastest on one thread each), and makes sure the workers end with the run."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from contextlib import contextmanager
from typing import Callable

from ..bench.timing import threads
from ..runtime import parent_death_signal


def _call_one_thread(fn, args):
    """fn(*args) on one thread: tiny models run fastest on one thread, since at these sizes a second thread
    costs more in synchronisation than it saves (and under load, far more). The cores are used by training
    models side by side instead."""
    with threads(1):
        return fn(*args)


def run_jobs(
    fn: Callable,
    jobs: list[tuple],
    desc: str,
    workers: int | None = None,
    show: bool = True,
    on_result: Callable[[int, object], None] | None = None,
) -> list:
    """[fn(*job) for job in jobs], one single-threaded job per core in separate processes (spawned, so each
    starts clean); in-process when there is one worker or one job. `fn` must be a module-level function.
    `on_result(i, result)` is called in this process as each job i finishes (what a long run saves as it goes).

    The workers end with this process, however it ends (`_worker_start` says how they follow a parent that
    dies, SIGKILL included). Ctrl-C and SIGTERM end the run at once: the workers ignore SIGINT (a terminal's
    Ctrl-C reaches the whole process group, and the parent alone decides), SIGTERM becomes SystemExit(143)
    while the pool runs (from the main thread, where it had the default action), and on any exception, a
    job's own included, the queued jobs are cancelled and the workers killed, instead of the pool's usual
    shutdown, which would run every queued job to its end first."""
    from concurrent.futures import ProcessPoolExecutor

    from tqdm.auto import tqdm

    if not jobs:
        return []
    workers = min(workers or os.cpu_count() or 1, len(jobs))
    with tqdm(total=len(jobs), desc=desc, unit="model", disable=not show) as bar:
        if workers <= 1:
            out = []
            for i, job in enumerate(jobs):
                out.append(_call_one_thread(fn, job))
                if on_result is not None:
                    on_result(i, out[-1])
                bar.update(1)
            return out
        results: list = [None] * len(jobs)
        with _sigterm_exits():
            pool = ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_start
            )
            try:
                futures = {pool.submit(_call_one_thread, fn, job): i for i, job in enumerate(jobs)}
                for future in _as_completed_waking(futures):
                    i = futures[future]
                    results[i] = future.result()
                    if on_result is not None:
                        on_result(i, results[i])
                    bar.update(1)
            except BaseException:
                _kill_workers(pool)
                raise
            pool.shutdown(wait=True)
        return results


WAKE_SECONDS = 0.5  # how often the parent's main thread wakes while it waits for its jobs


def _as_completed_waking(futures):
    """The futures as they complete, like `concurrent.futures.as_completed`, but waking every WAKE_SECONDS.
    The kernel delivers a process's SIGINT or SIGTERM to any of its threads that does not block it (the
    pool's management and feeder threads, tqdm's monitor); Python runs the handler only once the main
    thread returns to the interpreter, and a main thread blocked on a lock with no timeout (as_completed
    waiting for a 10-minute job) would not, until a job ended. Waking it turns a Ctrl-C into the
    KeyboardInterrupt that ends the run within WAKE_SECONDS."""
    from concurrent.futures import FIRST_COMPLETED, wait

    pending = set(futures)
    while pending:
        done, pending = wait(pending, timeout=WAKE_SECONDS, return_when=FIRST_COMPLETED)
        yield from done


def _worker_start() -> None:
    """A `run_jobs` worker's initializer: it ignores SIGINT (the parent handles Ctrl-C and kills the workers)
    and ends as soon as its parent process does, by two means.

    - Linux: prctl(PR_SET_PDEATHSIG, SIGKILL), so that the kernel kills the worker when its parent dies,
      whatever the worker is doing (even inside a long C call holding the GIL). The kernel sends it when the
      parent *thread* that forked the worker exits, not the process: ProcessPoolExecutor (3.10 to 3.13, spawn
      context) starts its workers in `submit`, from the thread that calls `run_jobs`, which does not return
      before every worker has exited (a worker replaced from the executor's manager thread, which only
      `max_tasks_per_child` does and `run_jobs` does not use, would be bound to that thread, which also
      outlives the workers). So the signal comes only when the parent process dies.
    - Everywhere: a daemon thread that waits on `multiprocessing.parent_process()`'s sentinel (the read end
      of the pipe the parent spawned the worker through, which reaches EOF when the parent dies; on Windows a
      handle to the parent process) and calls os._exit. It covers the other systems, a prctl that fails, and a
      parent that died before prctl ran (the sentinel is then already ready). It does not poll, and needs
      nothing from the parent: a parent killed by SIGKILL runs no code."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _parent_death_signal()
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_with, args=(parent,), name="k3-lab-parent-watch", daemon=True).start()


def _parent_death_signal() -> bool:
    return parent_death_signal(signal.SIGKILL)


def _exit_with(parent) -> None:
    parent.join()  # returns when the parent process has ended
    os._exit(1)


def _kill_workers(pool) -> None:
    """Cancel the pool's queued jobs and kill its workers now (SIGKILL: they hold nothing worth saving)."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    for process in processes:
        process.kill()
    for process in processes:
        process.join(10)
    pool.shutdown(wait=False, cancel_futures=True)


@contextmanager
def _sigterm_exits():
    """Inside the block, SIGTERM raises SystemExit(128 + SIGTERM), so that `run_jobs` kills its workers and the
    caller unwinds as after Ctrl-C. Only from the main thread, and only where SIGTERM had the default action;
    the previous handler comes back after."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def exit_on_sigterm(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
