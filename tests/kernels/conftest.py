"""fla's kernels on CPU tensors through Triton's interpreter: `make test-kernels` (TRITON_INTERPRET=1,
k3[cuda] installed). Every module here marks its tests `kernels` (`make test` leaves them out) and skips
them, saying why, where fla, triton or the interpreter is missing."""

from __future__ import annotations

import importlib.util
import os

import pytest

REASON = (
    "needs fla-core and triton (pip install 'k3[cuda]') and TRITON_INTERPRET=1 set before Python starts: "
    "make test-kernels"
)
READY = (
    importlib.util.find_spec("fla") is not None
    and importlib.util.find_spec("triton") is not None
    and os.environ.get("TRITON_INTERPRET") == "1"
)


@pytest.fixture(scope="session", autouse=True)
def bridged_interpreter():
    """The four bridges of tests/kernels/interpreter.py, applied once before any fla kernel runs; then fla
    imported, which compiles a few functions as it loads and so imports torch's inductor: before any test
    swaps an op of `torch.ops.k3` for a spy (inductor's import walks the registered ops)."""
    if READY:
        from .interpreter import install

        install()
        import fla.ops  # noqa: F401
    yield
