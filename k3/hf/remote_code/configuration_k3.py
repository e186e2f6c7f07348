"""K3Config of a model exported by k3 (`k3 export`), for transformers' remote code (config.json's
`auto_map`): k3's own `k3.hf.K3Config`. k3 must be installed; without it, an ImportError says how."""

try:  # transformers skips imports inside `try` when it lists what a remote-code file needs
    from k3.hf import K3Config as _K3Config
except ModuleNotFoundError as e:
    if e.name not in ("k3", "k3.hf"):
        raise  # something k3 itself needs is missing: that error says what
    raise ImportError(
        "this checkpoint was written by `k3 export` (model_type 'k3'): its model code is k3's own, and k3 "
        "is not installed. Install it: pip install 'k3[hf]' (or, from a clone of the k3 repository, "
        "pip install -e 'PATH/TO/k3[hf]'), then load it again"
    ) from e


class K3Config(_K3Config):
    """k3.hf.K3Config under this file's name (see k3/hf/remote_code/__init__.py)."""
