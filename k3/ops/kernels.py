"""Which kernels run k3's delta-family ops: k3's own PyTorch forms, or flash-linear-attention's (fla).

One public signature per op; the caller never chooses. The choice, per call:

- "torch": k3's own forms (`k3.ops.chunk`, the token loops), on any device.
- "fla":   fla's Triton kernels (`k3.ops.fla_kernels`) on any device: on a CPU that means Triton's
           interpreter, which must be on (`TRITON_INTERPRET=1` before fla is imported). For tests,
           benchmarks and bug reports.
- "auto" (the default): fla on a CUDA tensor when fla is installed (`pip install 'k3[cuda]'`), k3's own
  forms everywhere else.

The environment variable K3_KERNELS (torch, fla; unset or auto = automatic) sets the choice when k3.ops is
imported; `set_kernels` changes it at run time, `use_kernels` for a block. Where fla cannot take a case
(float64, a head dim above its limit, a chunk size it refuses, a gradient through a decode kernel that has
none), k3's own form runs and the logger `k3.ops.kernels` says why at DEBUG level.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
from typing import Callable

import torch

logger = logging.getLogger(__name__)

ENV = "K3_KERNELS"
CHOICES = ("auto", "torch", "fla")


def _parse(value: str | None, source: str) -> str:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{source} must be one of {', '.join(CHOICES)} (a string) or None, got {value!r}")
    choice = (value or "auto").strip().lower()
    if choice not in CHOICES:
        raise ValueError(f"{source} must be one of {', '.join(CHOICES)} (or unset), got {value!r}")
    return choice


def _from_environment() -> tuple[str, str | None]:
    """K3_KERNELS's choice, or ("auto", why) when it names none: importing k3 never fails on it; the
    command line refuses it in one line (`check_environment`), and an op refuses to run under it."""
    try:
        return _parse(os.environ.get(ENV), f"the environment variable {ENV}"), None
    except ValueError as e:
        return "auto", str(e)


_choice, _environment_error = _from_environment()


def check_environment() -> None:
    """ValueError when K3_KERNELS names no choice, or names fla where fla is not installed (the command
    line's first check, so that every command answers it in one line)."""
    if _environment_error is not None:
        raise ValueError(_environment_error)
    if _choice == "fla" and not fla_installed():
        raise ValueError(
            f"the environment variable {ENV}=fla needs flash-linear-attention and Triton: pip install "
            f"'k3[cuda]' (or set {ENV}=torch, or unset it)"
        )


def get_kernels() -> str:
    """The current choice: "auto", "torch" or "fla"."""
    if _environment_error is not None:
        raise ValueError(_environment_error)
    return _choice


def set_kernels(choice: str | None) -> str:
    """Make `choice` ("auto" or None, "torch", "fla") the kernels k3's ops run; returns the previous one.
    "fla" fails here, not at the first op, when fla is not installed."""
    global _choice, _environment_error
    new = _parse(choice, "set_kernels: `choice`")
    if new == "fla":
        require_fla()
    previous, _choice, _environment_error = _choice, new, None
    return previous


@contextlib.contextmanager
def use_kernels(choice: str | None):
    """`set_kernels(choice)` for the block, then the previous choice again."""
    previous = set_kernels(_parse(choice, "use_kernels: `choice`"))
    try:
        yield
    finally:
        set_kernels(previous)


_FLA_INSTALLED = importlib.util.find_spec("fla") is not None and importlib.util.find_spec("triton") is not None


def fla_installed() -> bool:
    """Whether fla (the `fla-core` package) and Triton can be imported (looked up when k3.ops is
    imported, not imported: k3 loads fla only when one of its kernels runs)."""
    return _FLA_INSTALLED


def require_fla() -> None:
    if not fla_installed():
        raise RuntimeError(
            f"k3 kernels 'fla' need flash-linear-attention and Triton: pip install 'k3[cuda]' (or set {ENV}=torch)"
        )


def kernels_words(device: torch.device | str) -> str:
    """What runs the delta family's ops on `device` under the current choice, in words for a header
    (`k3 train`'s header gives it on a GPU)."""
    on_cuda = torch.device(device).type == "cuda"
    if _choice == "fla" or (_choice == "auto" and on_cuda and fla_installed()):
        return "delta-family kernels: fla's (Triton)"
    if _choice == "auto" and on_cuda:
        return "delta-family kernels: k3's PyTorch forms (pip install 'k3[cuda]' for fla's)"
    return "delta-family kernels: k3's PyTorch forms"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def fla_runs(op: str, q: torch.Tensor, why_not: Callable[[], str | None]) -> bool:
    """Whether `op` on q's device runs fla's kernel under the current choice. `why_not()` gives the reason
    fla cannot take this case (None when it can; asked only where fla would run): that reason goes to
    the debug log and k3's own form runs."""
    if _environment_error is not None:
        raise ValueError(_environment_error)
    if _choice == "torch":
        return False
    on_cuda = q.device.type == "cuda"
    if _choice == "auto" and not (on_cuda and fla_installed()):
        return False
    if _choice == "fla":
        require_fla()
        if not on_cuda and not _interpreting():
            raise RuntimeError(
                f"{op}: k3 kernels 'fla' on a {q.device.type} tensor run through Triton's interpreter: "
                "set TRITON_INTERPRET=1 before k3 is imported (or use CUDA tensors)"
            )
    reason = why_not()
    if reason is not None:
        logger.debug("%s: k3's own form runs, not fla's kernel: %s", op, reason)
        return False
    return True
