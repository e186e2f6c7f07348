"""`k3.lab.jobs.run_jobs`'s worker processes end with their parent: killed (SIGKILL, with and without
PR_SET_PDEATHSIG), terminated (SIGTERM) or interrupted (Ctrl-C, SIGINT to the process group; and SIGINT
delivered to a thread other than the main one, as the kernel may deliver a Ctrl-C)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import k3

# the parent: 4 long jobs on 2 workers; each job writes its worker's pid, then sleeps. With K3_TEST_NO_PDEATHSIG
# the module-level patch also runs in each worker (spawn imports this script there as __mp_main__), leaving
# only the parent-watching thread to end them.
PARENT = """
import faulthandler
import os
import signal
import sys
import time

import k3.lab.jobs as jobs

if os.environ.get("K3_TEST_NO_PDEATHSIG"):
    jobs._parent_death_signal = lambda: False


def job(folder):
    with open(os.path.join(folder, f"{os.getpid()}.pid"), "w") as f:
        f.write("ok")
    time.sleep(600)


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks where a parent that hangs is
    jobs.run_jobs(job, [(sys.argv[1],)] * 4, "test", workers=2, show=False)
"""


def _as_from_a_terminal() -> None:
    """The parent starts with SIGINT's default action, as from a terminal: a test run in the background (a
    CI script's `cmd &`) inherits SIGINT ignored, and Python keeps an ignored SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _alive(pid: int) -> bool:
    """Running or sleeping: an orphaned worker may stay a zombie where the reaper (pid 1) does not reap."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _wait_for(condition, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("how", ["SIGKILL", "SIGKILL, no pdeathsig", "SIGTERM", "Ctrl-C", "SIGINT to another thread"])
def test_workers_end_with_their_parent(tmp_path, how):
    script, pids, log = tmp_path / "parent.py", tmp_path / "pids", tmp_path / "parent.log"
    script.write_text(PARENT)
    pids.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(k3.__file__).parents[1])}
    if how == "SIGKILL, no pdeathsig":
        env["K3_TEST_NO_PDEATHSIG"] = "1"
    with open(log, "w") as out:
        parent = subprocess.Popen(
            [sys.executable, str(script), str(pids)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_as_from_a_terminal,
        )
    workers: list[int] = []
    try:
        started = _wait_for(lambda: len(list(pids.iterdir())) == 2 or parent.poll() is not None, 120)
        assert started and parent.poll() is None, log.read_text()
        workers = [int(p.stem) for p in pids.iterdir()]
        assert all(_alive(pid) for pid in workers)
        if how == "Ctrl-C":
            os.killpg(parent.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole foreground group
        elif how == "SIGINT to another thread":  # where the kernel may deliver a Ctrl-C: the main thread must wake
            _signal_a_thread(parent.pid, signal.SIGINT)
        else:
            parent.send_signal(signal.SIGTERM if how == "SIGTERM" else signal.SIGKILL)
        try:
            parent.wait(timeout=30)  # SIGTERM and Ctrl-C: the parent kills its workers and exits by itself
        except subprocess.TimeoutExpired:  # where it hangs: every thread's stack, dumped to its log
            parent.send_signal(signal.SIGUSR1)
            time.sleep(2)
            raise AssertionError(f"the parent did not exit within 30 s of {how}:\n{log.read_text()}") from None
        assert parent.returncode != 0
        assert _wait_for(lambda: not any(_alive(pid) for pid in workers), 10), (
            f"workers still running: {[pid for pid in workers if _alive(pid)]}\n{log.read_text()}"
        )
        assert len(list(pids.iterdir())) == 2  # no queued job started as the pool went down
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


TGKILL = {"x86_64": 234, "aarch64": 131}  # the tgkill syscall's number (Linux)


def _signal_a_thread(pid: int, signum: int) -> None:
    """Send `signum` to one of process `pid`'s threads other than its main one (tgkill(2))."""
    import ctypes
    import platform

    if platform.machine() not in TGKILL:
        pytest.skip(f"tgkill's syscall number on {platform.machine()}")
    others = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
    assert others, "the parent has no other thread"
    assert ctypes.CDLL(None, use_errno=True).syscall(TGKILL[platform.machine()], pid, others[-1], signum) == 0


@pytest.mark.slow
def test_run_jobs_results_in_order_and_a_job_error_raises():
    import operator

    from k3.lab.jobs import run_jobs

    assert run_jobs(operator.add, [(1, 2), (3, 4), (5, 6)], "test", workers=2, show=False) == [3, 7, 11]
    with pytest.raises(ZeroDivisionError):
        run_jobs(operator.truediv, [(1, 0), (1, 1)], "test", workers=2, show=False)
