"""k3: Kimi K3 and the lineage that leads to it, in PyTorch.

`k3.ops` holds the sequence mixers (softmax attention, linear attention, DeltaNet, Gated DeltaNet,
Kimi Delta Attention), each as a token-by-token recurrence and a chunkwise-parallel form that agree;
`k3.layers` the building blocks; `k3.models` the models from GPT-2 to Kimi K3 (`get_config`,
`CausalLM`, `count_params`); `k3.inference` sampling and generation through the hybrid cache;
`k3.checkpoints` the checkpoint formats and `from_pretrained`; `k3.training` training (`train`,
`TrainConfig`).

The names users reach for first are importable from here (`from k3 import CausalLM, get_config`);
they load on first use, so `import k3.ops` does not pull in the models or the training code.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "CausalLM": "k3.models",
    "Cache": "k3.models",
    "ModelConfig": "k3.models",
    "get_config": "k3.models",
    "count_params": "k3.models",
    "PRESETS": "k3.models",
    "TrainConfig": "k3.training",
    "train": "k3.training",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'k3' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
