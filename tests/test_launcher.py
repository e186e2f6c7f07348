"""A torchrun worker ends with its launcher (`k3.runtime.exit_with_launcher`, which `k3`'s command line
and the training loop's `Distributed` call): after `kill -9` of the launcher, no worker trains on as an
orphan. The launcher here is a stand-in that starts its worker as torchrun's agent does (Popen from its
main thread, a new session, TORCHELASTIC_RUN_ID in the environment)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

WORKER = (
    "import time; from k3.runtime import exit_with_launcher; print(exit_with_launcher(), flush=True); time.sleep(60)"
)
LAUNCHER = f"""
import os, subprocess, sys, time
env = dict(os.environ, **dict(a.split("=", 1) for a in sys.argv[1:]))
out = subprocess.PIPE
worker = subprocess.Popen([sys.executable, "-c", {WORKER!r}], env=env, start_new_session=True, stdout=out, text=True)
print(worker.pid, worker.stdout.readline().strip(), flush=True)
time.sleep(60)
"""


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def launch(*env: str) -> tuple[subprocess.Popen, int, str]:
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, *env], stdout=subprocess.PIPE, text=True)
    pid, set_ = launcher.stdout.readline().split()
    return launcher, int(pid), set_


def test_a_torchrun_worker_ends_when_its_launcher_is_killed():
    launcher, worker, set_ = launch("TORCHELASTIC_RUN_ID=test")
    assert set_ == "True"
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 20
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(worker)


def test_outside_torchrun_nothing_is_set():
    launcher, worker, set_ = launch()
    try:
        assert set_ == "False"
        launcher.kill()
        launcher.wait()
        time.sleep(0.5)
        assert alive(worker)  # a process not started by torchrun is left alone
    finally:
        os.kill(worker, signal.SIGKILL)
