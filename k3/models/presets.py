"""The lineage as presets (docs/design.md: models): GPT-2 → linear attention → DeltaNet → Gated DeltaNet →
Kimi Linear → Kimi K3, each at its published size and as a `-tiny` that a 2-core CPU trains in minutes.

`get_config(name, **overrides)` builds one; `num_layers` rebuilds the preset's layer pattern at that depth,
`layer_types` / `mlp_types` set your own pattern (the depth follows them), any other ModelConfig field is
set as given.
"""

from __future__ import annotations

import difflib
from typing import Callable

from .config import ModelConfig, check_field_names


def _hybrid(num_layers: int, period: int = 4, last_mla: bool = True) -> list[str]:
    """KDA with every `period`-th layer MLA (1-based 4, 8, ...), and the last layer MLA when asked."""
    types = ["mla" if (i + 1) % period == 0 else "kda" for i in range(num_layers)]
    if last_mla:
        types[-1] = "mla"
    return types


def _dense_first(num_layers: int) -> list[str]:
    return ["dense"] + ["moe"] * (num_layers - 1)


def gpt2(num_layers: int = 12, **kw) -> ModelConfig:
    base = dict(
        name="gpt2",
        vocab_size=50304,
        hidden_size=768,
        num_heads=12,
        norm="layernorm",
        norm_eps=1e-5,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        ffn_activation="gelu",
        intermediate_size=3072,
    )
    return ModelConfig(
        num_layers=num_layers, layer_types=["mha"] * num_layers, mlp_types=["dense"] * num_layers, **{**base, **kw}
    )


def _lineage(mixer: str, name: str, output_gate: str | None):
    def build(num_layers: int = 12, **kw) -> ModelConfig:
        base = dict(
            name=name,
            vocab_size=50304,
            hidden_size=768,
            linear_num_heads=12,
            linear_head_dim=64,
            linear_output_gate=output_gate,
            ffn_activation="swiglu",
            intermediate_size=2048,
        )
        return ModelConfig(
            num_layers=num_layers, layer_types=[mixer] * num_layers, mlp_types=["dense"] * num_layers, **{**base, **kw}
        )

    return build


def kimi_linear(num_layers: int = 27, **kw) -> ModelConfig:
    """Kimi-Linear-48B-A3B: KDA at 1-3, 5-7, ..., 25-26 and MLA at 4, 8, ..., 24, 27 (1-based)."""
    base = dict(
        name="kimi-linear",
        vocab_size=163840,
        hidden_size=2304,
        norm_eps=1e-5,
        num_heads=32,
        linear_num_heads=32,
        linear_head_dim=128,
        kda_gate="kimi_linear",
        linear_output_gate="low_rank",
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        ffn_activation="swiglu",
        intermediate_size=9216,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=1024,
        num_shared_experts=1,
        routed_scaling_factor=2.446,
    )
    return ModelConfig(
        num_layers=num_layers, layer_types=_hybrid(num_layers), mlp_types=_dense_first(num_layers), **{**base, **kw}
    )


def kimi_k3(num_layers: int = 93, last_mla: bool = True, **kw) -> ModelConfig:
    """Kimi K3's public configuration: 69 KDA + 24 MLA (MLA at 4, 8, ..., 92 and 93, 1-based)."""
    base = dict(
        name="kimi-k3",
        vocab_size=163840,
        hidden_size=7168,
        norm_eps=1e-5,
        num_heads=96,
        linear_num_heads=96,
        linear_head_dim=128,
        kda_gate="safe",
        linear_output_gate="full",
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        mla_output_gate=True,
        ffn_activation="situ",
        intermediate_size=33792,
        situ_beta=4.0,
        situ_linear_beta=25.0,
        num_experts=896,
        num_experts_per_tok=16,
        moe_intermediate_size=3072,
        num_shared_experts=2,
        moe_latent_size=3584,
        routed_scaling_factor=1.0,
        attn_res_block_size=12,
    )
    return ModelConfig(
        num_layers=num_layers,
        layer_types=_hybrid(num_layers, last_mla=last_mla),
        mlp_types=_dense_first(num_layers),
        **{**base, **kw},
    )


def kimi_k3_article(num_layers: int = 92, **kw) -> ModelConfig:
    """The article's reading: 23 x [KDA, KDA, KDA, MLA] = 92 layers, otherwise Kimi K3."""
    return kimi_k3(num_layers, last_mla=False, **{"name": "kimi-k3-article", **kw})


# -- tiny versions: same structure, 2-core-CPU sizes -------------------------------------------------
_TINY_COMMON = dict(vocab_size=4096, hidden_size=128)
_TINY_MIXER = dict(num_heads=4, linear_num_heads=4, linear_head_dim=32)
_TINY_MLA = dict(kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
_TINY_MOE = dict(intermediate_size=512, moe_intermediate_size=64)


# arguments of a preset's builder that are no ModelConfig field
_PRESET_ARGUMENTS = ("last_mla",)


def _tiny(build: Callable[..., ModelConfig], name: str, num_layers: int, **sizes):
    def tiny(num_layers: int = num_layers, **kw) -> ModelConfig:
        return build(num_layers, **{"name": name, **_TINY_COMMON, **sizes, **kw})

    return tiny


PRESETS: dict[str, Callable[..., ModelConfig]] = {
    "gpt2": gpt2,
    "linear-attn": _lineage("linear_attn", "linear-attn", None),
    "deltanet": _lineage("deltanet", "deltanet", None),
    "gated-deltanet": _lineage("gated_deltanet", "gated-deltanet", "full"),
    "kimi-linear": kimi_linear,
    "kimi-k3": kimi_k3,
    "kimi-k3-article": kimi_k3_article,
}
PRESETS.update(
    {
        "gpt2-tiny": _tiny(gpt2, "gpt2-tiny", 4, num_heads=4, intermediate_size=512, max_position_embeddings=1024),
        "linear-attn-tiny": _tiny(PRESETS["linear-attn"], "linear-attn-tiny", 4, **_TINY_MIXER, intermediate_size=352),
        "deltanet-tiny": _tiny(PRESETS["deltanet"], "deltanet-tiny", 4, **_TINY_MIXER, intermediate_size=352),
        "gated-deltanet-tiny": _tiny(
            PRESETS["gated-deltanet"], "gated-deltanet-tiny", 4, **_TINY_MIXER, intermediate_size=352
        ),
        "kimi-linear-tiny": _tiny(
            kimi_linear,
            "kimi-linear-tiny",
            8,
            **_TINY_MIXER,
            **_TINY_MLA,
            **_TINY_MOE,
            num_experts=8,
            num_experts_per_tok=2,
        ),
        # Kimi K3's shape in 5 layers (KDA, KDA, KDA, MLA + the final MLA), width 192: on the 2-core CPU
        # this trains twice as many tokens per second as 9 layers at width 128, and reaches a lower
        # validation loss in the same minutes (measured; see docs/benchmarks.md)
        "kimi-k3-tiny": _tiny(
            kimi_k3,
            "kimi-k3-tiny",
            5,
            **_TINY_MIXER,
            **_TINY_MLA,
            **_TINY_MOE,
            hidden_size=192,
            q_lora_rank=64,
            num_experts=16,
            num_experts_per_tok=4,
            moe_latent_size=64,
            attn_res_block_size=2,
        ),
        "kimi-k3-article-tiny": _tiny(
            kimi_k3_article,
            "kimi-k3-article-tiny",
            8,
            **_TINY_MIXER,
            **_TINY_MLA,
            **_TINY_MOE,
            hidden_size=192,
            q_lora_rank=64,
            num_experts=16,
            num_experts_per_tok=4,
            moe_latent_size=64,
            attn_res_block_size=2,
        ),
    }
)


def get_config(name: str, **overrides) -> ModelConfig:
    """The preset `name` (see PRESETS) with `overrides` applied: any ModelConfig field. `num_layers`
    rebuilds the preset's layer pattern at that depth; `layer_types` and/or `mlp_types` give your own
    pattern, and `num_layers` follows their length (the other list keeps the preset's pattern):

        get_config("kimi-linear-tiny", layer_types=["kda", "kda", "kda", "mla"] * 2)   # 8 layers, 3:1
    """
    if name not in PRESETS:
        close = difflib.get_close_matches(str(name), PRESETS, n=3, cutoff=0.5)
        hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
        raise ValueError(f"get_config: unknown preset {name!r}; {hint}the presets are: {', '.join(PRESETS)}")
    check_field_names([k for k in overrides if k not in _PRESET_ARGUMENTS], f"get_config({name!r})")
    pattern = {}
    for key in ("layer_types", "mlp_types"):
        if key in overrides:
            value = overrides.pop(key)
            if isinstance(value, str) or not isinstance(value, (list, tuple)):
                raise ValueError(
                    f"get_config({name!r}): `{key}` must be a list with one entry per layer, e.g. "
                    f"['kda', 'kda', 'kda', 'mla'] (from the command line, JSON: --set "
                    f'\'{key}=["kda", "mla"]\'), got {value!r}'
                )
            pattern[key] = list(value)
    if pattern:
        lengths = {key: len(value) for key, value in pattern.items()}
        if "num_layers" in overrides:
            lengths["num_layers"] = overrides["num_layers"]
        if len(set(lengths.values())) > 1:
            given = ", ".join(f"`{key}` {'is' if key == 'num_layers' else 'has'} {n}" for key, n in lengths.items())
            raise ValueError(
                f"get_config({name!r}): {given}: the layer lists give the depth; give them one "
                f"entry per layer each (num_layers may be left out: it follows them)"
            )
        depth = next(iter(lengths.values()))
        if depth < 1:
            raise ValueError(f"get_config({name!r}): `{next(iter(pattern))}` is empty; give one entry per layer")
        overrides["num_layers"] = depth
    depth = overrides.get("num_layers", 1)
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"get_config({name!r}): `num_layers` must be an int >= 1, got {depth!r}")
    config = PRESETS[name](**overrides)
    return config.replace(**pattern) if pattern else config
