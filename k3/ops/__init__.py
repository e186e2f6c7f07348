"""k3.ops: the lineage's sequence mixers as pure functions (docs/design.md: tensor conventions, the sequence mixers).

Every op takes `[B, T, H, K]` inputs and returns `(o, final_state)`. Each recurrent mixer has a
token-by-token reference form (`recurrent_*`, also the decode step) and a chunkwise-parallel form
(`chunk_*`) with one shared signature; the two agree to rounding error.

Layout: one file per op, its token loop beside its chunk form (attention, linear_attn, delta_rule,
gated_delta_rule, kda). The delta family shares delta_family (argument checks, the token-loop frame),
chunk (the chunkwise engine), ut (the UT transform) and numerics (gate clamps and flushes); common holds
the checks and packing every op uses; cost counts the multiply-adds the chunk forms run (for the
capacity planner and `k3 lab prefill`).

Kernels: on a CUDA device with flash-linear-attention installed (`pip install 'k3[cuda]'`) the delta
family runs fla's Triton kernels (`fla_kernels`, as PyTorch custom ops), elsewhere k3's own forms;
`set_kernels` / `use_kernels` / the environment variable K3_KERNELS force either (`kernels`).
"""

from .attention import attention
from .common import l2norm
from .delta_rule import chunk_delta_rule, recurrent_delta_rule
from .gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from .kda import chunk_kda, recurrent_kda
from .kernels import get_kernels, set_kernels, use_kernels
from .linear_attn import chunk_linear_attn, recurrent_linear_attn

__all__ = [
    "attention",
    "recurrent_linear_attn",
    "chunk_linear_attn",
    "recurrent_delta_rule",
    "chunk_delta_rule",
    "recurrent_gated_delta_rule",
    "chunk_gated_delta_rule",
    "recurrent_kda",
    "chunk_kda",
    "l2norm",
    "get_kernels",
    "set_kernels",
    "use_kernels",
]
