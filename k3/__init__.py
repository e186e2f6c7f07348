"""k3: Kimi K3 and the lineage that leads to it, in PyTorch.

`k3.ops` holds the sequence mixers (softmax attention, linear attention, DeltaNet, Gated DeltaNet,
Kimi Delta Attention), each as a token-by-token recurrence and a chunkwise-parallel form that agree.
"""

__version__ = "0.1.0"
