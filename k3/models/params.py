"""Parameter and memory accounting from a ModelConfig alone (no module is built): where the
parameters go, how many one token activates, and what decoding keeps per token and per sequence.

The per-layer figures come from the kinds tables (`k3.models.kinds`), whose formulas mirror the
layers' constructors; tests check the totals against real modules (tiny presets) and modules on the
meta device (full presets).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoints.checkpoint import config_from_json
from ..runtime import refuse_if_over_memory
from .config import ModelConfig
from .kinds import FFNS, MIXERS

GPT2_PARAMS = 124_475_904  # `gpt2` preset (vocab 50304, tied head)
ARTICLE_GPT2_RATIO = 22_580  # the article's "how many GPT-2s fit in Kimi K3"


@dataclass
class ParamCount:
    """Totals and a breakdown (component -> parameters); see `count_params`."""

    total: int
    active: int
    breakdown: dict[str, int] = field(default_factory=dict)
    mla_cache_bytes_per_token: int = 0  # all MLA layers together
    kv_cache_bytes_per_token: int = 0  # all MHA layers together
    recurrent_state_bytes_per_sequence: int = 0  # all linear-family layers, conv states included


def _norm_params(c: ModelConfig, dim: int) -> int:
    return 2 * dim if c.norm == "layernorm" else dim


def count_params(config: ModelConfig, cache_dtype_bytes: int = 2) -> ParamCount:
    """Total and per-token active parameters of `config` (active: everything a token is multiplied by,
    i.e. without the unchosen routed experts and the embedding lookups), a breakdown, and decode memory:
    MLA latent cache and MHA KV cache bytes per token (at `cache_dtype_bytes` per value, bf16 by
    default) and recurrent-state bytes per sequence (fp32 states, conv states at the cache dtype)."""
    c, d = config, config.hidden_size
    parts: dict[str, int] = {}

    def add(key: str, n: int) -> None:
        parts[key] = parts.get(key, 0) + n

    add("embeddings", c.vocab_size * d + (c.max_position_embeddings or 0) * d)
    if not c.tie_word_embeddings:
        add("lm_head", c.vocab_size * d)
    unused = 0
    for kind, ffn in zip(c.layer_types, c.mlp_types):
        add(f"attention ({kind})", MIXERS[kind].params(c))
        add("norms", 2 * _norm_params(c, d))
        for key, n in FFNS[ffn].params(c).items():
            add(key, n)
        unused += FFNS[ffn].unused_per_token(c)
    add("norms", _norm_params(c, d))
    if c.attn_res_block_size is not None:
        add("AttnRes", (2 * c.num_layers + 1) * 2 * d)

    total = sum(parts.values())
    # Active: what one token multiplies by. The embedding tables are looked up, not multiplied (one
    # row per token), so they are not active unless tied to the output head; routed experts count
    # only for the k chosen.
    lookups = (0 if c.tie_word_embeddings else c.vocab_size * d) + (c.max_position_embeddings or 0) * d

    def per_token(kind: str) -> int:
        return sum(MIXERS[kind].cache_bytes_per_token(c, cache_dtype_bytes) for t in c.layer_types if t == kind)

    return ParamCount(
        total=total,
        active=total - unused - lookups,
        breakdown=parts,
        mla_cache_bytes_per_token=per_token("mla"),
        kv_cache_bytes_per_token=per_token("mha"),
        recurrent_state_bytes_per_sequence=sum(MIXERS[t].state_bytes(c, cache_dtype_bytes) for t in c.layer_types),
    )


def config_for(source: str) -> ModelConfig:
    """A preset's name, a checkpoint directory or a config.json path (k3's or a Kimi one: the published
    Kimi K3 config.json gives the kimi-k3 preset) -> its ModelConfig."""
    from .presets import PRESETS, get_config

    if source in PRESETS:
        return get_config(source)
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"{source!r} is neither a preset (choose from: {', '.join(PRESETS)}) nor a "
            f"checkpoint directory or config.json"
        )
    return config_from_json(path, ModelConfig)[0]


def weight_bytes(config: ModelConfig, mxfp4_experts: bool = False) -> int:
    """Bytes of the weights in bfloat16, or with the routed experts in MXFP4 (4.25 bits a weight: a
    4-bit code each and a scale byte per 32) and the rest in bfloat16."""
    pc = count_params(config)
    routed = pc.breakdown.get("routed experts", 0) if mxfp4_experts else 0
    return 2 * (pc.total - routed) + routed * 17 // 32


def layer_bytes(config: ModelConfig, index: int, mxfp4_experts: bool = False) -> int:
    """Bytes of decoder layer `index`'s weights (as `weight_bytes`): what `from_pretrained(layers=...)`
    holds per layer, besides the embedding, head and final norms."""
    c = config
    ffn = FFNS[c.mlp_types[index]].params(c)
    routed = ffn.get("routed experts", 0) if mxfp4_experts else 0
    n = MIXERS[c.layer_types[index]].params(c) + sum(ffn.values()) + 2 * _norm_params(c, c.hidden_size)
    if c.attn_res_block_size is not None:
        n += 2 * 2 * c.hidden_size
    return 2 * (n - routed) + routed * 17 // 32


def refuse_if_too_big(
    config: ModelConfig, bytes_per_parameter: int, purpose: str, fix: str, share: float = 1.0
) -> None:
    """ValueError, before anything is allocated, when `config`'s parameters at `bytes_per_parameter`
    bytes each (4: float32 weights; 16: training with AdamW) are more than this machine's memory.
    `share`: the part of them this machine holds (its processes' shards of a sharded run; 1: all)."""
    total = count_params(config).total
    held = f", {share:.3g} of them on this machine" if share != 1 else ""
    refuse_if_over_memory(
        f"{purpose} {config.name!r} ({total:,} parameters x {bytes_per_parameter} bytes{held})",
        int(total * bytes_per_parameter * share),
        fix,
    )


def _human(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3f}{unit}"
    return str(int(n))


def format_report(config: ModelConfig, vs: ModelConfig | None = None) -> str:
    """The `k3 params` table: totals, breakdown, decode memory, and optionally the ratio to `vs`."""
    pc = count_params(config)
    lines = [
        f"{config.name}: {config.num_layers} layers ({_layer_summary(config)}), d {config.hidden_size}, "
        f"vocab {config.vocab_size}",
        f"  total parameters   {pc.total:>20,}  ({_human(pc.total)})",
        f"  active per token   {pc.active:>20,}  ({_human(pc.active)})",
        "",
        "  breakdown:",
    ]
    for key, n in sorted(pc.breakdown.items(), key=lambda kv: -kv[1]):
        lines.append(f"    {key:<26} {n:>20,}  {100 * n / pc.total:6.2f}%")
    lines += ["", "  weights in memory:", f"    bf16                   {_bytes(weight_bytes(config))}"]
    if pc.breakdown.get("routed experts"):
        lines.append(
            f"    routed experts MXFP4   {_bytes(weight_bytes(config, True))}  (4.25 bits a weight; the rest bf16)"
        )
    i = next((i for i, t in enumerate(config.mlp_types) if t == "moe"), 0)
    kind = f"{config.layer_types[i]} + {config.mlp_types[i]}"
    lines.append(f"    decoder layer {i:<8} {_bytes(layer_bytes(config, i))}  ({kind}, bf16)")
    if config.mlp_types[i] == "moe":
        lines.append(f"      routed experts MXFP4 {_bytes(layer_bytes(config, i, True))}")
    lines += ["", "  decode memory (bf16 caches, fp32 recurrent states):"]
    if pc.mla_cache_bytes_per_token:
        per_layer = (config.kv_lora_rank + config.qk_rope_head_dim) * 2
        lines.append(
            f"    MLA latent cache       {pc.mla_cache_bytes_per_token:>12,} bytes/token "
            f"({config.layer_types.count('mla')} layers x {per_layer} bytes: "
            f"{config.kv_lora_rank} + {config.qk_rope_head_dim} values)"
        )
    if pc.kv_cache_bytes_per_token:
        lines.append(f"    MHA KV cache           {pc.kv_cache_bytes_per_token:>12,} bytes/token")
    if pc.recurrent_state_bytes_per_sequence:
        lines.append(
            f"    recurrent state        {pc.recurrent_state_bytes_per_sequence:>12,} bytes/sequence "
            f"(constant in length)"
        )
    if vs is not None:
        other = count_params(vs)
        ratio = pc.total / other.total
        lines += ["", f"  {config.name} / {vs.name}: {pc.total:,} / {other.total:,} = {ratio:,.2f}"]
        if vs.name == "gpt2" and config.name.startswith("kimi-k3"):
            lines.append(
                f"  the article says {ARTICLE_GPT2_RATIO:,}; this count gives {ratio:,.0f} "
                f"({ratio - ARTICLE_GPT2_RATIO:+,.0f}, {100 * (ratio / ARTICLE_GPT2_RATIO - 1):+.2f}%)"
            )
            lines.append(
                f"  the article's figure is the rounded totals' ratio: 2.8T / 124M = {2.8e12 / 124e6:,.1f}; "
                f"exact counts give {pc.total / 1e12:.4f}T / {other.total / 1e6:.2f}M"
            )
    return "\n".join(lines)


def _bytes(n: float) -> str:
    return f"{n:>20,.0f} bytes ({binary_bytes(n)})"


def binary_bytes(n: float) -> str:
    """`n` bytes in the largest binary unit that leaves at least 1 (KiB, MiB, GiB, TiB), 3 significant digits."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            value = n / size
            return f"{value:,.{max(0, 2 - len(str(int(value))) + 1)}f} {unit}"
    return f"{n:,.0f} bytes"


def _layer_summary(c: ModelConfig) -> str:
    counts: dict[str, int] = {}
    for kind in c.layer_types:
        counts[kind] = counts.get(kind, 0) + 1
    return " + ".join(f"{n} {kind}" for kind, n in counts.items())
