"""K3ForCausalLM of a model exported by k3 (`k3 export`), for transformers' remote code (config.json's
`auto_map`): k3's own `k3.hf.K3ForCausalLM`, with the K3Config of configuration_k3.py."""

from .configuration_k3 import K3Config  # first: without k3 it raises the ImportError that says what to install

from k3.hf import K3ForCausalLM as _K3ForCausalLM  # noqa: E402


class K3ForCausalLM(_K3ForCausalLM):
    """k3.hf.K3ForCausalLM under this file's name (see k3/hf/remote_code/__init__.py)."""

    config_class = K3Config
