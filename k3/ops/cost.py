"""What k3's chunk ops cost, per head, in multiply-adds: the article's model of the chunked form,
2·L·d² + 2·L·C·d (`article_cost`), and what k3's `chunk_linear_attn` and `chunk_kda` run, every matmul
and triangular solve counted (`k3_cost`; a test checks it against the matmuls and solves the ops
dispatch). A count from the ops' structure, not a timing: the capacity planner (`k3.plan.costs`) prices
the linear family's sequence term with it, and `k3 lab prefill` sets both models against the clock."""

from __future__ import annotations

import math

import torch

from .gates import halving_levels, sub_chunk_size

OPS = ("linear_attn", "kda")  # the ops k3_cost counts, `chunk_<op>` in k3.ops


def _check_shape(T: int, d: int, C: int) -> None:
    for name, value in (("T", T), ("d", d), ("C", C)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"cost model: `{name}` must be a positive int, got {value!r}")


def _sub_chunk_scores(S: int, levels: int) -> int:
    """Multiply-adds / d of one gated score matrix inside a sub-chunk of S tokens halved `levels` times:
    the lower-left quadrants of each level's blocks (h x h, h = S / 2^(j+1); 1 x 1 ones are elementwise),
    then the remaining diagonal blocks of b = S / 2^levels tokens whole (b x b; none when b = 1)."""
    quadrants = sum((1 << j) * h * h for j in range(levels) if (h := S >> (j + 1)) > 1)
    b = S >> levels
    return quadrants + (S * b if b > 1 else 0)


def article_cost(T: int, d: int, C: int) -> float:
    """The article's cost of the chunked form per head, 2·L·d² + 2·L·C·d (in multiply-adds: it counts a
    (C x d)(d x d) product as C·d·d). C larger than T means one chunk, C = T."""
    _check_shape(T, d, C)
    C = min(C, T)
    return 2.0 * T * d * d + 2.0 * T * C * d


def k3_cost(op: str, T: int, d: int, C: int, lower_bound: float | None = None) -> float:
    """Multiply-adds per head of k3's `chunk_<op>` (K = V = d), every matmul and triangular solve counted.

    linear_attn: per chunk K_iᵀ V1_i and Q_i S (V1 = [V | 1], d + 1 columns) and the full C x C score
    block Q_i K_iᵀ times V1_i.
    kda: per chunk of C = m·s tokens (sub-chunks of s <= 32, as the op splits them) the state steps
    W S, K_endᵀ U and Q S (3·C·d²); the blocks of A_qk and A_kk below the diagonal (s²·d·m(m - 1)/2 each)
    and, inside each sub-chunk (padded to S, a power of two), their quadrants by halves (S(S - 2)/2·d
    each: the 1 x 1 quadrants are elementwise products) — with `lower_bound` (float32 `chunk_kda(...,
    lower_bound=)`, Kimi K3's safe gate) the halving stops at blocks of b tokens (`halving_levels`),
    each computed whole (b²·d); the UT transform applied to K and V
    (C·d·(C + s)) and A_qk U (C·d·(C + s)/2); and the inverse of I + A: a triangular solve per diagonal
    block (s²(s - 1)/2 each) and its block rows, s³·m(m² - 1)/3 — about C³/3, the term the article's
    model does not have. The last chunk is padded to C tokens."""
    _check_shape(T, d, C)
    C = min(C, T)
    padded = math.ceil(T / C) * C
    if op == "linear_attn":
        return padded * (2.0 * d * (d + 1) + C * (2.0 * d + 1))
    if op == "kda":
        s = sub_chunk_size(C)
        m, S = C // s, 1 << (s - 1).bit_length()
        scores = d * m * (s * s * (m - 1) + 2 * _sub_chunk_scores(S, halving_levels(S, lower_bound, torch.float32)))
        per_chunk = (
            3.0 * C * d * d + 1.5 * C * d * (C + s) + scores + m * s * s * (s - 1) / 2 + s**3 * m * (m * m - 1) / 3
        )
        return padded // C * per_chunk
    raise ValueError(f"k3_cost: `op` must be one of {OPS}, got {op!r}")


LINEAR_OP = {"linear_attn": "linear_attn", "deltanet": "kda", "gated_deltanet": "kda", "kda": "kda"}


def mixer_macs_per_token(config, kind: str, seq_len: int) -> float:
    """Sequence-term multiply-adds of one `kind` layer of a model `config` (a k3 ModelConfig) per token,
    forward, over sequences of `seq_len` (see k3.plan.costs for the terms)."""
    c = config
    if kind == "mha":
        return c.hidden_size * (seq_len + 1)  # H heads x (d/H + d/H) x (T + 1) / 2
    if kind == "mla":
        return c.num_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) * (seq_len + 1) / 2
    op = LINEAR_OP[kind]
    bound = c.kda_gate_lower_bound if kind == "kda" and c.kda_gate == "safe" else None  # K3's safe gate
    return c.linear_num_heads * k3_cost(op, seq_len, c.linear_head_dim, c.chunk_size, lower_bound=bound) / seq_len
