"""k3 and Hugging Face transformers (the optional extra `k3[hf]`, transformers >= 4.57).

Importing this module registers model_type "k3" with AutoConfig and AutoModelForCausalLM, so a
directory written by `k3 export` (or `K3ForCausalLM.save_pretrained`) loads with
`AutoModelForCausalLM.from_pretrained(dir)`. Without the import, the directory's remote code does it
(`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`: `k3.hf.remote_code`).
`k3.hf.export` writes that format, or Kimi Linear's own (model_type "kimi_linear") for the models it can
express.
"""

try:
    import transformers
except ModuleNotFoundError as e:  # pragma: no cover - depends on the environment
    raise ModuleNotFoundError("k3.hf needs Hugging Face transformers >= 4.57: pip install 'k3[hf]'", name=e.name) from e

from .modeling import CACHE_ARG, K3Cache, K3Config, K3ForCausalLM

transformers.AutoConfig.register(K3Config.model_type, K3Config, exist_ok=True)
transformers.AutoModelForCausalLM.register(K3Config, K3ForCausalLM, exist_ok=True)

__all__ = ["CACHE_ARG", "K3Cache", "K3Config", "K3ForCausalLM"]
