"""Read a Kimi Linear / Kimi K3 `config.json` into ModelConfig fields, and write one.

Both spellings of Kimi Linear are read: the Hub's (`linear_attn_config` with 1-based `full_attn_layers`
/ `kda_layers`, `first_k_dense_replace`, `num_experts`, `num_experts_per_token`, `num_shared_experts`)
and transformers' (`layer_types`, `mlp_layer_types`, `linear_head_dim`, `num_local_experts`, ...). A
multimodal wrapper's nested `text_config` is used when present (Kimi K3's: `model_type: "kimi_k3"`).

Kimi K3's own fields, as its published config.json spells them: `linear_attn_config.gate_lower_bound`
(the safe KDA gate g = lower_bound * sigmoid(.); K3: -5), `linear_attn_config.use_full_rank_gate`
(full-rank KDA output gate), `mla_use_output_gate` (gated MLA), `routed_expert_hidden_size` (the latent
MoE width) with `latent_moe_use_norm`, `hidden_act: "situ"` with `activation_situ_beta` /
`activation_situ_linear_beta` (absent: beta 1 and no clamp, as the official code), `attn_res_block_size`.
Older k3 checkpoints used names of k3's own (`linear_lower_bound`, top-level `use_full_rank_gate`,
`moe_latent_size`, `situ_beta`, `situ_linear_beta`): they are still read, never written.

`moe_renormalize` is read (top-k weights over their sum plus 1e-20 when k > 1, as K3's code; false:
the bare sigmoid scores). What k3 cannot compute is refused with the field's name: grouped routing, a
router other than sigmoid top-k, RoPE MLA, multi-token-prediction layers, a `quantization_config` other
than compressed-tensors MXFP4 for the routed experts (`check_quantization`).

`ModelConfig.from_hf` builds a config from `fields_from_hf`; the writers take any ModelConfig.
"""

from __future__ import annotations


def json_kind(value) -> str:
    """What a parsed JSON value is, in JSON's words (for errors): null, true or false, a number, ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    kind = {dict: "an object", list: "a list", str: "a string"}.get(type(value), "a number")
    return f"{kind} ({value!r:.40})" if kind != "an object" else kind


def _first(d: dict, *names, default=None):
    for name in names:
        if name in d and d[name] is not None:
            return d[name]
    return default


def _layer_types(cfg: dict, n: int) -> list[str]:
    if cfg.get("layer_types"):
        mapping = {"full_attention": "mla", "linear_attention": "kda", "mla": "mla", "kda": "kda"}
        try:
            return [mapping[t] for t in cfg["layer_types"]]
        except KeyError as e:
            raise ValueError(f"ModelConfig.from_hf: unknown entry {e.args[0]!r} in `layer_types`") from None
    lin = cfg.get("linear_attn_config") or {}
    if "full_attn_layers" in lin or "kda_layers" in lin:
        types = ["mla"] * n
        for i in lin.get("kda_layers", []):
            if not 1 <= i <= n:
                raise ValueError(f"ModelConfig.from_hf: `kda_layers` entry {i} outside 1..{n} (they are 1-based)")
            types[i - 1] = "kda"
        return types
    if lin:
        raise ValueError("ModelConfig.from_hf: `linear_attn_config` has neither `full_attn_layers` nor `kda_layers`")
    return ["mla"] * n  # a plain MLA model (DeepSeek-style)


def _mlp_types(cfg: dict, n: int) -> list[str]:
    if cfg.get("mlp_layer_types"):
        return ["moe" if t in ("sparse", "moe") else "dense" for t in cfg["mlp_layer_types"]]
    if not _first(cfg, "num_experts", "num_local_experts", "n_routed_experts", default=0):
        return ["dense"] * n
    first_dense = _first(cfg, "first_k_dense_replace", default=1)
    freq = _first(cfg, "moe_layer_freq", default=1)
    return ["moe" if i >= first_dense and i % freq == 0 else "dense" for i in range(n)]


# the context both published configs declare (`max_position_embeddings` in Kimi K3's, `model_max_length` in
# Kimi Linear's): KDA and NoPE MLA have no position limit of their own, so an export declares the same
CONTEXT_LENGTH = 1_048_576
MXFP4_FORMAT = "mxfp4-pack-quantized"
# the weights' quantization args of compressed-tensors' MXFP4 scheme, as Kimi K3's config.json gives them
MXFP4_WEIGHTS = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32}


def check_quantization(quant: dict | None) -> None:
    """Refuse a `quantization_config` that k3 cannot read: anything but compressed-tensors MXFP4
    (`format: "mxfp4-pack-quantized"`, 4-bit float weights in groups of 32, uint8 E8M0 scales, no
    activation quantization). None (an unquantized checkpoint) passes."""
    if quant is None:
        return
    if not isinstance(quant, dict):
        raise ValueError(f"ModelConfig.from_hf: `quantization_config` must be a dict, got {type(quant).__name__}")
    method = quant.get("quant_method")
    groups = quant.get("config_groups") or {}
    formats = {quant.get("format")} | {g.get("format") for g in groups.values() if g.get("format")}
    problems = [] if method == "compressed-tensors" else [f"`quant_method` {method!r} (k3 reads 'compressed-tensors')"]
    if formats - {None} != {MXFP4_FORMAT}:
        problems.append(f"`format` {sorted(f for f in formats if f)} (k3 reads {MXFP4_FORMAT!r})")
    for name, group in groups.items():
        weights = group.get("weights") or {}
        wrong = {k: weights.get(k) for k, v in MXFP4_WEIGHTS.items() if weights.get(k) != v}
        if weights.get("scale_dtype") not in (None, "torch.uint8"):
            wrong["scale_dtype"] = weights["scale_dtype"]
        if wrong:
            problems.append(f"`config_groups.{name}.weights` {wrong} (k3 reads {MXFP4_WEIGHTS})")
        if group.get("input_activations"):
            problems.append(f"`config_groups.{name}.input_activations` (k3 quantizes weights only)")
    if problems:
        raise ValueError(
            "ModelConfig.from_hf: this `quantization_config` is not one k3 can read: " + "; ".join(problems)
        )


def _situ(cfg: dict) -> tuple[float, float | None]:
    """(beta, linear beta) of SiTU: the published names, else k3's old ones, else the official defaults."""
    if "activation_situ_beta" in cfg or "activation_situ_linear_beta" in cfg:
        return cfg.get("activation_situ_beta", 1.0), cfg.get("activation_situ_linear_beta")
    if "situ_beta" in cfg:  # written by k3 before the published names were known
        return cfg["situ_beta"], cfg.get("situ_linear_beta")
    return 1.0, None


def _refusals(cfg: dict, lin: dict) -> list[str]:
    """What k3 cannot compute in this text config, each naming its field."""
    groups, topk_groups = _first(cfg, "num_expert_group", "n_group", default=1), _first(cfg, "topk_group", default=1)
    act = cfg.get("hidden_act", "silu")
    checks = (
        (
            groups > 1 and topk_groups < groups,
            f"group-limited routing ({topk_groups} of {groups} expert groups, `num_expert_group` / `topk_group`); "
            f"k3 routes over all experts",
        ),
        (
            cfg.get("moe_router_activation_func", "sigmoid") != "sigmoid",
            f"`moe_router_activation_func` {cfg.get('moe_router_activation_func')!r} (k3's router is sigmoid)",
        ),
        (
            cfg.get("topk_method", "noaux_tc") not in ("noaux_tc", "greedy"),
            f"`topk_method` {cfg.get('topk_method')!r} (k3 chooses by score + correction bias: 'noaux_tc')",
        ),
        (cfg.get("mla_use_nope") is False, "RoPE MLA (`mla_use_nope: false`); k3's MLA is NoPE"),
        (
            bool(cfg.get("num_nextn_predict_layers")),
            f"{cfg.get('num_nextn_predict_layers')} multi-token-prediction layers (`num_nextn_predict_layers`)",
        ),
        (act not in ("silu", "situ"), f"`hidden_act` {act!r} (silu or situ)"),
        (cfg.get("latent_moe_use_norm") is False, "a latent MoE without its RMSNorm (`latent_moe_use_norm: false`)"),
    )
    return [what for bad, what in checks if bad]


# the JSON types of the fields read here before ModelConfig checks its own (null is taken as absent)
_INT, _NUMBER, _BOOL = "an integer", "a number", "true or false"
_TEXT, _LIST, _OBJECT = "a string", "a list", "an object"
HF_TYPES = {
    **dict.fromkeys(("num_hidden_layers", "hidden_size", "vocab_size", "num_expert_group", "n_group"), _INT),
    **dict.fromkeys(("topk_group", "first_k_dense_replace", "moe_layer_freq", "num_nextn_predict_layers"), _INT),
    **dict.fromkeys(("hidden_act", "moe_router_activation_func", "topk_method", "model_type"), _TEXT),
    **dict.fromkeys(("layer_types", "mlp_layer_types"), _LIST),
    **dict.fromkeys(("linear_attn_config", "quantization_config"), _OBJECT),
    "linear_lower_bound": _NUMBER,
    **dict.fromkeys(("tie_word_embeddings", "mla_use_output_gate", "use_full_rank_gate", "mla_use_nope"), _BOOL),
    **dict.fromkeys(("latent_moe_use_norm", "moe_renormalize", "norm_topk_prob"), _BOOL),
}
HF_LINEAR_TYPES = {"kda_layers": _LIST, "full_attn_layers": _LIST, "gate_lower_bound": _NUMBER}
HF_LINEAR_TYPES["use_full_rank_gate"] = _BOOL
_IS = {
    _INT: lambda v: isinstance(v, int) and not isinstance(v, bool),
    _NUMBER: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    _BOOL: lambda v: isinstance(v, bool),
    _TEXT: lambda v: isinstance(v, str),
    _LIST: lambda v: isinstance(v, list),
    _OBJECT: lambda v: isinstance(v, dict),
}


def _check_types(cfg: dict, hf: dict) -> None:
    """ValueError naming the first field of a Kimi config.json whose value has the wrong JSON type (a
    number written as text, a list as one name); the three sizes it needs may not be null."""
    for name in ("num_hidden_layers", "hidden_size", "vocab_size"):
        if cfg[name] is None:
            raise ValueError(f"ModelConfig.from_hf: `{name}` must be {_INT}, got null")
    lin = cfg.get("linear_attn_config") if isinstance(cfg.get("linear_attn_config"), dict) else {}
    checks = [(name, kind, cfg.get(name)) for name, kind in HF_TYPES.items()]
    checks += [(name, _TEXT, hf.get(name)) for name in ("model_type", "_name_or_path")]
    checks += [(f"linear_attn_config.{name}", kind, lin.get(name)) for name, kind in HF_LINEAR_TYPES.items()]
    for name, kind, value in checks:
        if value is not None and not _IS[kind](value):
            raise ValueError(f"ModelConfig.from_hf: `{name}` must be {kind}, got {json_kind(value)}")
    lists = [(f"linear_attn_config.{k}", _INT, lin.get(k)) for k in ("kda_layers", "full_attn_layers")]
    lists += [(k, _TEXT, cfg.get(k)) for k in ("layer_types", "mlp_layer_types")]
    for name, kind, values in lists:
        for value in values or []:
            if not _IS[kind](value):
                raise ValueError(f"ModelConfig.from_hf: each entry of `{name}` must be {kind}, got {json_kind(value)}")


def fields_from_hf(hf: dict) -> dict:
    """The ModelConfig fields (a dict for `ModelConfig(**fields)`) that a Kimi config.json describes."""
    cfg = hf.get("text_config") or hf
    if not isinstance(cfg, dict):
        raise ValueError(f"ModelConfig.from_hf: expected a dict (a parsed config.json), got {type(cfg).__name__}")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if k not in cfg]
    if missing:
        raise ValueError(
            f"ModelConfig.from_hf: the config has no {missing}; is this a Kimi Linear / Kimi K3 config.json?"
        )
    _check_types(cfg, hf)
    n = cfg["num_hidden_layers"]
    lin = cfg.get("linear_attn_config") or {}
    problems = _refusals(cfg, lin)
    if problems:
        raise ValueError("ModelConfig.from_hf: k3 cannot compute " + "; ".join(problems))
    check_quantization(cfg.get("quantization_config", hf.get("quantization_config")))
    lower = _first(lin, "gate_lower_bound", default=cfg.get("linear_lower_bound"))
    act = cfg.get("hidden_act", "silu")
    situ = dict(zip(("situ_beta", "situ_linear_beta"), _situ(cfg))) if act == "situ" else {}
    return dict(
        name=hf.get("_name_or_path") or (hf.get("model_type") or cfg.get("model_type") or "hf").replace("_", "-"),
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_layers=n,
        layer_types=_layer_types(cfg, n),
        mlp_types=_mlp_types(cfg, n),
        norm="rmsnorm",
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        num_heads=cfg.get("num_attention_heads", 1),
        linear_num_heads=_first(lin, "num_heads", default=_first(cfg, "linear_num_heads", "num_attention_heads")),
        linear_head_dim=_first(lin, "head_dim", default=_first(cfg, "linear_head_dim", default=128)),
        conv_size=_first(lin, "short_conv_kernel_size", default=_first(cfg, "linear_conv_kernel_dim", default=4)),
        kda_gate="safe" if lower is not None else "kimi_linear",
        kda_gate_lower_bound=float(lower) if lower is not None else -5.0,
        linear_output_gate="full"
        if _first(lin, "use_full_rank_gate", default=cfg.get("use_full_rank_gate"))
        else "low_rank",
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=cfg.get("kv_lora_rank", 512),
        qk_nope_head_dim=cfg.get("qk_nope_head_dim", 128),
        qk_rope_head_dim=cfg.get("qk_rope_head_dim", 64),
        v_head_dim=cfg.get("v_head_dim") or 128,
        mla_output_gate=bool(cfg.get("mla_use_output_gate", False)),
        ffn_activation="situ" if act == "situ" else "swiglu",
        intermediate_size=cfg.get("intermediate_size", 4 * cfg["hidden_size"]),
        **situ,
        num_experts=_first(cfg, "num_experts", "num_local_experts", "n_routed_experts", default=0),
        num_experts_per_tok=_first(cfg, "num_experts_per_token", "num_experts_per_tok", default=0),
        moe_intermediate_size=cfg.get("moe_intermediate_size", 0),
        num_shared_experts=_first(cfg, "num_shared_experts", "n_shared_experts", default=0),
        moe_latent_size=_first(cfg, "routed_expert_hidden_size", "moe_latent_size"),
        routed_scaling_factor=cfg.get("routed_scaling_factor", 1.0),
        moe_renormalize=bool(cfg.get("moe_renormalize", cfg.get("norm_topk_prob", True))),
        attn_res_block_size=cfg.get("attn_res_block_size"),
    )


# ModelConfig fields that a Kimi config.json spells otherwise (the others keep their names)
HF_FIELD_NAMES = {
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "norm_eps": "rms_norm_eps",
    "linear_num_heads": "linear_attn_config.num_heads",
    "linear_head_dim": "linear_attn_config.head_dim",
    "conv_size": "linear_attn_config.short_conv_kernel_size",
    "moe_latent_size": "routed_expert_hidden_size",
}


def hf_field_name(field: str) -> str:
    """The name a Kimi config.json gives ModelConfig's `field` (its text config's, in Kimi K3's wrapper)."""
    return HF_FIELD_NAMES.get(field, field)


def config_to_hf(config) -> dict:
    """The Kimi Linear `config.json` fields (Hub spelling) for a KDA/MLA config; K3 fields by their
    published names (module docstring)."""
    c = config
    if not set(c.layer_types) <= {"kda", "mla"} or c.norm != "rmsnorm":
        raise ValueError(
            f"config_to_hf: only KDA/MLA models have a Kimi config.json; {c.name!r} has {sorted(set(c.layer_types))}"
        )
    first_dense = next((i for i, t in enumerate(c.mlp_types) if t == "moe"), c.num_layers)
    out = {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_layers,
        "intermediate_size": c.intermediate_size,
        "rms_norm_eps": c.norm_eps,
        "tie_word_embeddings": c.tie_word_embeddings,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_heads,
        "q_lora_rank": c.q_lora_rank,
        "kv_lora_rank": c.kv_lora_rank,
        "qk_nope_head_dim": c.qk_nope_head_dim,
        "qk_rope_head_dim": c.qk_rope_head_dim,
        "v_head_dim": c.v_head_dim,
        "mla_use_nope": True,
        "hidden_act": "situ" if c.ffn_activation == "situ" else "silu",
        "num_experts": c.num_experts,
        "num_experts_per_token": c.num_experts_per_tok,
        "moe_intermediate_size": c.moe_intermediate_size,
        "num_shared_experts": c.num_shared_experts,
        "routed_scaling_factor": c.routed_scaling_factor,
        "moe_renormalize": c.moe_renormalize,
        "moe_router_activation_func": "sigmoid",
        "topk_method": "noaux_tc",
        "first_k_dense_replace": first_dense,
        "moe_layer_freq": 1,
        "num_expert_group": 1,
        "topk_group": 1,
        "num_nextn_predict_layers": 0,
        # the published files' remaining fields: what transformers' and vLLM's loaders read
        "head_dim": c.hidden_size // c.num_heads,
        "use_grouped_topk": True,
        "initializer_range": 0.02,
        "use_cache": True,
        "linear_attn_config": {
            "full_attn_layers": [i + 1 for i, t in enumerate(c.layer_types) if t == "mla"],
            "kda_layers": [i + 1 for i, t in enumerate(c.layer_types) if t == "kda"],
            "num_heads": c.linear_num_heads,
            "head_dim": c.linear_head_dim,
            "short_conv_kernel_size": c.conv_size,
        },
    }
    lin = out["linear_attn_config"]
    if c.kda_gate == "safe":
        lin["gate_lower_bound"] = c.kda_gate_lower_bound
    if c.linear_output_gate == "full":
        lin["use_full_rank_gate"] = True
    if c.mla_output_gate:
        out["mla_use_output_gate"] = True
    if c.moe_latent_size:
        out.update(routed_expert_hidden_size=c.moe_latent_size, latent_moe_use_norm=True)
    if c.ffn_activation == "situ":
        out["activation_situ_beta"] = c.situ_beta
        if c.situ_linear_beta is not None:  # absent: no clamp of `up`
            out["activation_situ_linear_beta"] = c.situ_linear_beta
    if c.attn_res_block_size:
        out["attn_res_block_size"] = c.attn_res_block_size
    return out


def kimi_linear_config(config) -> dict:
    """config_to_hf for a model that Kimi Linear's code (transformers' KimiLinearForCausalLM) computes
    exactly as k3 does; anything else is refused, naming what Kimi Linear's format cannot express
    (the K3 fields above are k3's extension: Kimi Linear's code ignores them)."""
    c = config
    moe = [i for i, t in enumerate(c.mlp_types) if t == "moe"]
    other_mixers = sorted(set(c.layer_types) - {"kda", "mla"})
    problems = [
        what
        for bad, what in (
            (other_mixers, f"layer types {other_mixers} (only KDA and MLA)"),
            (c.norm != "rmsnorm", f"norm {c.norm!r} (only RMSNorm)"),
            (c.kda_gate != "kimi_linear", "the safe KDA gate (kda_gate 'safe')"),
            (c.linear_output_gate != "low_rank", f"KDA output gate {c.linear_output_gate!r} (only 'low_rank')"),
            (c.mla_output_gate, "gated MLA (mla_output_gate)"),
            (c.rope_theta is not None, "RoPE in MLA (rope_theta; Kimi Linear's MLA is NoPE)"),
            (c.ffn_activation != "swiglu", f"ffn_activation {c.ffn_activation!r} (only 'swiglu')"),
            (c.moe_latent_size is not None, "a latent MoE (moe_latent_size)"),
            (c.attn_res_block_size is not None, "Block Attention Residuals (attn_res_block_size)"),
            (moe and moe != list(range(moe[0], c.num_layers)), "dense FFN layers after the first MoE layer"),
            (moe and c.num_shared_experts < 1, "MoE layers without a shared expert"),
        )
        if bad
    ]
    if problems:
        raise ValueError(
            f"{c.name!r} cannot be written in Kimi Linear's format, which cannot express: "
            + "; ".join(problems)
            + ". Export it in k3's own format instead (k3 export without --format)"
        )
    return {**config_to_hf(c), "model_max_length": CONTEXT_LENGTH, "rope_theta": 10000.0}
