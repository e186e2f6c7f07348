"""k3.runtime.keep_freed_memory: applies on Linux/glibc, can be refused by the environment."""

from __future__ import annotations

import sys

import pytest

from k3.runtime import keep_freed_memory


def test_opt_out_is_respected(monkeypatch):
    monkeypatch.setenv("K3_KEEP_FREED_MEMORY", "0")
    assert keep_freed_memory() is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux-only")
def test_applies_on_linux(monkeypatch):
    monkeypatch.delenv("K3_KEEP_FREED_MEMORY", raising=False)
    assert keep_freed_memory() in (True, False)  # False only on a non-glibc libc (musl)
    assert keep_freed_memory() == keep_freed_memory()  # idempotent
