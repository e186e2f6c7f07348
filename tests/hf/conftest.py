"""One torch thread for these tests: their tensors are tiny, and on a busy 2-core machine a second
thread only adds waiting (greedy generation of 24 tokens on a small kimi-k3-tiny: 0.6 s with one
thread, 12 s with two, measured while other jobs ran)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
