"""Shared fixtures for the model tests: tiny presets at a small vocabulary (same structure, faster)."""

from __future__ import annotations

import pytest
import torch

from k3.models import PRESETS, CausalLM, get_config

TINY = [name for name in PRESETS if name.endswith("-tiny")]


def tiny_model(name: str, seed: int = 0, **overrides) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(get_config(name, **{"vocab_size": 512, **overrides})).eval()


@pytest.fixture(params=TINY)
def tiny_name(request) -> str:
    return request.param
