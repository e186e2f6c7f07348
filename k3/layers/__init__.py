"""k3.layers: the building blocks of the lineage's models (docs/design.md: the layers).

RMSNorm, the feed-forward family (GPT-2's GELU MLP, SwiGLU, Kimi K3's SiTU-GLU), the short
causal convolution, the delta-rule attention layers (DeltaNet, Gated DeltaNet, Kimi Delta Attention)
and Multi-head Latent Attention (each reading and writing its decode state through the cache the caller
passes, `k3.inference.cache`), the (latent) mixture of experts, and Block
Attention Residuals. `k3.models` assembles them.
"""

from .attention import MultiHeadAttention
from .attnres import BlockAttnRes, DepthSources
from .conv import ShortConvolution
from .ffn import GatedMLP, GeluMLP, situ
from .linear_attention import (
    DeltaNet,
    GatedDeltaNet,
    KimiDeltaAttention,
    LinearAttention,
)
from .mla import MultiHeadLatentAttention
from .moe import Expert, MoE, RoutedExperts, Router
from .norm import RMSNorm

__all__ = [
    "MultiHeadAttention",
    "LinearAttention",
    "RMSNorm",
    "GeluMLP",
    "GatedMLP",
    "situ",
    "ShortConvolution",
    "DeltaNet",
    "GatedDeltaNet",
    "KimiDeltaAttention",
    "MultiHeadLatentAttention",
    "MoE",
    "Expert",
    "RoutedExperts",
    "Router",
    "BlockAttnRes",
    "DepthSources",
]
