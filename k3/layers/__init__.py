"""k3.layers: the building blocks of the lineage's models (docs/design.md: the layers).

RMSNorm, the feed-forward family (GPT-2's GELU MLP, SwiGLU, Kimi K3's SiTU-GLU), the short
causal convolution, the delta-rule attention layers (DeltaNet, Gated DeltaNet, Kimi Delta Attention)
and Multi-head Latent Attention, each with its decode cache, the (latent) mixture of experts, and Block
Attention Residuals. `k3.models` assembles them.
"""

from .attention import KVCache, MultiHeadAttention, StaticKVCache
from .attnres import BlockAttnRes, DepthSources
from .cache import LayerCache, StaticSequenceCache
from .conv import ShortConvolution
from .ffn import GatedMLP, GeluMLP, situ
from .linear_attention import (
    DeltaNet,
    GatedDeltaNet,
    KimiDeltaAttention,
    LinearAttention,
)
from .mla import LatentCache, MultiHeadLatentAttention, StaticLatentCache
from .moe import Expert, MoE, RoutedExperts, Router
from .norm import RMSNorm
from .recurrent_cache import RecurrentCache, StaticRecurrentCache

__all__ = [
    "MultiHeadAttention",
    "KVCache",
    "LinearAttention",
    "RMSNorm",
    "GeluMLP",
    "GatedMLP",
    "situ",
    "ShortConvolution",
    "DeltaNet",
    "GatedDeltaNet",
    "KimiDeltaAttention",
    "RecurrentCache",
    "MultiHeadLatentAttention",
    "LatentCache",
    "MoE",
    "Expert",
    "RoutedExperts",
    "Router",
    "BlockAttnRes",
    "LayerCache",
    "StaticSequenceCache",
    "StaticKVCache",
    "StaticLatentCache",
    "StaticRecurrentCache",
    "DepthSources",
]
