"""k3.models: the lineage's models (docs/design.md) — configs and presets, CausalLM with its hybrid
cache, parameter accounting, and loading Hugging Face Kimi checkpoints."""

from .config import ModelConfig
from .model import CausalLM, HybridCache
from .params import ParamCount, count_params
from .presets import PRESETS, get_config

__all__ = ["ModelConfig", "CausalLM", "HybridCache", "ParamCount", "count_params", "PRESETS", "get_config"]
