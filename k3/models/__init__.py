"""k3.models: the lineage's models (docs/design.md) — configs and presets, CausalLM with its hybrid
cache, and parameter accounting. CausalLM's generation and its checkpoints (from_pretrained, including
Hugging Face Kimi checkpoints, and save_pretrained) are `k3.inference`'s and `k3.checkpoints`', which it
hands itself to."""

from .config import ModelConfig
from .model import Cache, CausalLM
from .params import ParamCount, count_params
from .presets import PRESETS, get_config

__all__ = ["ModelConfig", "CausalLM", "Cache", "ParamCount", "count_params", "PRESETS", "get_config"]
