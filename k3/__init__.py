"""k3: Kimi K3 and the lineage that leads to it, in PyTorch.

`k3.ops` holds the sequence mixers (softmax attention, linear attention, DeltaNet, Gated DeltaNet,
Kimi Delta Attention), each as a token-by-token recurrence and a chunkwise-parallel form that agree;
`k3.layers` the building blocks; `k3.models` the models from GPT-2 to Kimi K3 (`get_config`,
`CausalLM`, `count_params`); `k3.generation` sampling through the hybrid cache.
"""

__version__ = "0.1.0"
