"""How `k3 train` stops on a signal: Ctrl-C (SIGINT), SIGTERM (what `kill`, systemd, a batch scheduler and
torchrun send) and SIGHUP (a closed terminal) all read the same.

While the run starts (corpus, tokenizer, model) a signal stops it at once: nothing has been trained, and the
output folder is left as it was. Once the steps run, the first signal asks the run to stop after the
current step, which it then saves (all processes of a torchrun job at the same step: the loop asks every
rank whether any was signalled); a second one stops it at once, without saving, the folder as its last
save left it (k3's saves are all-or-nothing). Either way the run ends with `Interrupted`, a
KeyboardInterrupt that carries the signal (the exit code is 128 + its number: 130, 143, 129) and whether
the run already said what happened.

torchrun forwards a SIGTERM or SIGINT it gets to every worker, which may have had it already (a terminal's
Ctrl-C or `kill` of the process group reaches them all): a repeat within REPEAT_SECONDS of the first is
taken as the same request. It then waits `--shutdown_timeout` seconds (30 by default) before SIGKILL: a
step and a save must fit in it.
"""

from __future__ import annotations

import signal
import sys
import threading
import time

SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
REPEAT_SECONDS = 1.0  # a second signal sooner than this is the first one forwarded (torchrun), not a second press


class Interrupted(KeyboardInterrupt):
    """The run stopped on signal `signum`; `said`: it printed what it saved (or did not)."""

    def __init__(self, signum: int = signal.SIGINT, said: bool = False):
        super().__init__(signal_words(signum))
        self.signum, self.said = int(signum), said


def signal_words(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


class stop_on_signals:
    """Install the handlers of SIGNALS for the block (main thread only; the previous ones are restored).
    Until `steps_begin()` a signal raises Interrupted at once; after it the first only sets `requested`
    (`signum` says which) and the second raises Interrupted. `during` names what the first one lets
    finish ("this step", or "the final evaluation and save"), for its message."""

    def __init__(self):
        self.requested, self.signum, self.steps, self.during = False, None, False, "this step"
        self._previous, self._first = {}, 0.0

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def steps_begin(self) -> None:
        self.steps = True

    def _handle(self, signum, frame):
        if not self.steps:
            raise Interrupted(signum)
        if self.requested:
            if time.monotonic() - self._first < REPEAT_SECONDS:
                return  # the launcher forwarding what every process got
            raise Interrupted(self.signum)
        self.requested, self.signum, self._first = True, signum, time.monotonic()
        from .parallel.dims import launch

        if launch().rank == 0:  # one message for a torchrun job
            again = "press Ctrl-C again" if signum == signal.SIGINT else f"send {signal_words(signum)} again"
            print(
                f"\n{signal_words(signum)}: stopping after {self.during} and saving a checkpoint ({again} to "
                f"stop at once, without saving)",
                file=sys.stderr,
                flush=True,
            )

    def __exit__(self, *exc):
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}
        return False
