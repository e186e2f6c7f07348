"""The remote-code module `k3 export` copies into every export in k3's format: `configuration_k3.py` and
`modeling_k3.py`, named in config.json's `auto_map` (transformers' convention for custom models), so
`AutoConfig` / `AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` and `pipeline(...)`
load the export in an interpreter that never imported k3.

The files hold no model code: each imports k3's own class from `k3.hf` and subclasses it under the same
name (the subclasses add nothing). The subclass is what transformers marks when it loads remote code
(`register_for_auto_class`): a model loaded this way saves again with these two files and its
auto_map, while k3's own K3Config / K3ForCausalLM are left as they are.
"""

REMOTE_CODE_FILES = ("configuration_k3.py", "modeling_k3.py")
AUTO_MAP = {"AutoConfig": "configuration_k3.K3Config", "AutoModelForCausalLM": "modeling_k3.K3ForCausalLM"}
