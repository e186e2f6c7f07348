"""k3.layers: the building blocks of the lineage's models (DESIGN.md §3).

So far: RMSNorm, the feed-forward family (GPT-2's GELU MLP, SwiGLU, Kimi K3's SiTU-GLU) and the short
causal convolution that the delta-rule mixers put in front of q, k and v.
"""

from .conv import ShortConvolution
from .ffn import GatedMLP, GeluMLP, situ
from .norm import RMSNorm

__all__ = ["RMSNorm", "GeluMLP", "GatedMLP", "situ", "ShortConvolution"]
