"""What one token costs a model, from its structure: FLOPs (training and decoding) and the activation
bytes the backward pass keeps.

FLOPs (2 per multiply-add): the matmuls are 2 x the active parameters forward (`count_params`' active:
everything a token multiplies by, the k chosen experts only); the sequence terms are each mixer's own:

- softmax attention (mha) and MLA, causal: a query at position t scores t keys and sums t values,
  (T + 1) / 2 on average over a sequence of T: H (d_qk + d_v) (T + 1) / 2 multiply-adds per token;
- the linear family (KDA, DeltaNet, Gated DeltaNet, linear attention), chunked: k3's cost model of its
  own chunk ops (`k3.ops.cost.k3_cost`: every matmul and triangular solve `chunk_kda` and
  `chunk_linear_attn` run, UT transform included), per head, divided by T.

Training is 3 x forward (the backward pass is two matmuls for each of the forward's). Decoding one
token at context T: MLA attends in its absorbed form (the heads' scores and values against the cached
latents directly: H T (2 r + d_rope) multiply-adds), softmax attention 2 d T, the linear family one
recurrent step per head (about 4 K^2).

Activations (`activation_bytes_per_token`): what the backward pass needs of one token in one layer,
counted tensor by tensor from the layer's structure (bf16, 2 bytes a value; router scores and the
softmax statistics in fp32; kernels save q, k, v and their output, as flash attention and fla's
chunk kernels do, the chunk states recomputed). Each tensor is marked by what would recompute it:
"norm" (a norm's output), "act" (an activation function's or a gate's output), "up" (MLA's
up-projections q, k, v from the latents) or "keep". Recompute "none" keeps all; "selective" recomputes
the norm, act and up tensors (DeepSeek-V3's choice, section 3.2.3: RMSNorm and MLA up-projections, plus
Megatron-LM's moe_act); "full" keeps each layer's input and recomputes the layer in the backward pass.
An estimate of what a good implementation keeps, not a measurement of k3's (which runs on one device).
"""

from __future__ import annotations

from ..models import ModelConfig, count_params
from ..ops.cost import mixer_macs_per_token

RECOMPUTE = ("none", "selective", "full")


def train_flops_per_token(config: ModelConfig, seq_len: int) -> dict[str, float]:
    """Training FLOPs per token (forward + backward = 3 x forward), by term: "matmuls (6 x active)" and
    one sequence term per mixer kind present."""
    out = {"matmuls (6 x active)": 6.0 * count_params(config).active}
    for kind in dict.fromkeys(config.layer_types):
        n = config.layer_types.count(kind)
        out[f"sequence ({kind})"] = 6.0 * n * mixer_macs_per_token(config, kind, seq_len)
    return out


def decode_flops_per_token(config: ModelConfig, context: int) -> dict[str, float]:
    """FLOPs of decoding one token after `context` cached tokens, by term (see the module docstring)."""
    c = config
    out = {"matmuls (2 x active)": 2.0 * count_params(c).active}
    per_layer = {
        "mha": 2.0 * c.hidden_size * context,
        "mla": c.num_heads * context * (2 * c.kv_lora_rank + c.qk_rope_head_dim),
    }
    for kind in dict.fromkeys(c.layer_types):
        macs = per_layer.get(kind, 4.0 * c.linear_num_heads * c.linear_head_dim**2)
        out[f"sequence ({kind})"] = 2.0 * c.layer_types.count(kind) * macs
    return out


def _mixer_tensors(c: ModelConfig, kind: str) -> list[tuple[float, str]]:
    d = c.hidden_size
    if kind == "mha":
        return [(d, "norm"), (3 * d, "keep"), (d, "keep"), (2 * c.num_heads, "keep")]  # x, qkv, out, fp32 lse
    if kind == "mla":
        H, qk, dv, r = c.num_heads, c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        t = [(d, "norm")]
        if c.q_lora_rank:
            t += [(c.q_lora_rank, "keep"), (c.q_lora_rank, "norm")]  # q_a output, its norm
        t += [
            (r + c.qk_rope_head_dim, "keep"),
            (r, "norm"),
            (2 * H * qk + H * dv, "up"),  # kv_a, norm; q, k, v
            (H * dv, "keep"),
            (2 * H, "keep"),
        ]  # attention output, fp32 statistics
        if c.mla_output_gate:
            t += [(H * dv, "keep"), (H * dv, "act")]  # the gate's logits, the gated output (o_proj's input)
        return t
    H, K, inner = c.linear_num_heads, c.linear_head_dim, c.linear_num_heads * c.linear_head_dim
    t = [(d, "norm"), (3 * inner, "keep"), (3 * inner, "act"), (H, "act")]  # q,k,v before / after conv+SiLU, beta
    t += {
        "kda": [(K, "keep"), (inner, "keep"), (2 * inner, "act")],  # f_a out, f_b out, the gate (fp32)
        "gated_deltanet": [(H, "keep"), (2 * H, "act")],
    }.get(kind, [])
    t += [(inner, "keep"), (inner, "norm")]  # the op's output, its per-head norm
    gate = {"full": [(inner, "keep")], "low_rank": [(K, "keep"), (inner, "keep")], None: []}[c.linear_output_gate]
    return t + gate + ([(inner, "act")] if gate else [])  # the gated output (o_proj's input)


def _ffn_tensors(c: ModelConfig, kind: str) -> list[tuple[float, str]]:
    d = c.hidden_size
    if kind == "dense":
        h = c.intermediate_size
        if c.ffn_activation == "gelu":
            return [(d, "norm"), (h, "keep"), (h, "act")]
        return [(d, "norm"), (2 * h, "keep"), (h, "act")]  # w1 and w3 outputs, the activation (w2's input)
    h, k, E = c.moe_intermediate_size, c.num_experts_per_tok, c.num_experts
    width = c.moe_latent_size or d
    t = [(d, "norm"), (2 * E, "keep")]  # x, router scores in fp32
    if c.moe_latent_size:
        t += [(width, "keep"), (width, "norm"), (width, "keep")]  # down_proj out, latent norm (twice: in and out)
    t += [(k * width, "keep"), (2 * k * h, "keep"), (k * h, "act"), (k * width, "keep")]  # per chosen expert
    if c.num_shared_experts:
        s = c.num_shared_experts * h
        t += [(2 * s, "keep"), (s, "act")]
    return t


def layer_values(config: ModelConfig, index: int, recompute: str) -> float:
    """Activation values (2-byte units) layer `index` keeps per token for the backward pass, besides
    the layer's input (counted by `activation_bytes_per_token`)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"--recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    if recompute == "full":
        return 0.0
    d = config.hidden_size
    tensors = [(d, "keep")] + _mixer_tensors(config, config.layer_types[index])  # + the post-attention norm's input
    tensors += _ffn_tensors(config, config.mlp_types[index])
    dropped = {"none": (), "selective": ("norm", "act", "up")}[recompute]
    return sum(n for n, tag in tensors if tag not in dropped)


def activation_bytes_per_token(config: ModelConfig, layers: range, recompute: str) -> dict[str, float]:
    """Bytes per token one micro-batch keeps for `layers` under `recompute`, by part: the layers' inputs,
    what the layers keep inside, the recompute working set (one layer at "none" detail, under full
    recompute), Block AttnRes' block sums (fp32) and the output logits (bf16 + the fp32 softmax)."""
    c = config
    out = {
        "layer inputs": 2.0 * c.hidden_size * len(layers),
        "inside the layers": 2.0 * sum(layer_values(c, i, recompute) for i in layers),
    }
    if recompute == "full":
        out["recompute working set"] = 2.0 * max(layer_values(c, i, "none") for i in layers)
    if c.attn_res_block_size is not None:
        out["AttnRes block sums"] = 4.0 * c.hidden_size * (-(-len(layers) // c.attn_res_block_size) + 1)
    if layers and layers[-1] == c.num_layers - 1:
        out["logits"] = 6.0 * c.vocab_size
    return out
