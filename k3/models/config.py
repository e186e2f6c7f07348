"""ModelConfig: one dataclass describes every model of the lineage, from GPT-2 to Kimi K3.

A model is a stack of `num_layers` decoder layers; layer i has a sequence mixer `layer_types[i]` and a
feed-forward `mlp_types[i]`:

    mixers  "mha" (GPT-2 softmax attention)   "linear_attn" (ELU+1)   "deltanet"   "gated_deltanet"
            "kda" (Kimi Delta Attention)      "mla" (Multi-head Latent Attention)
    FFNs    "dense" (GELU MLP for GPT-2, else a gated MLP)   "moe" (mixture of experts)

Everything else is sizes and switches; `validate()` runs on construction and names the field at fault.
What each kind requires of these fields is checked by the kind itself (`k3.models.kinds`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from dataclasses import dataclass, field

from ..checkpoints.hf_config import fields_from_hf, json_kind
from . import kinds

MIXERS = tuple(kinds.MIXERS)
LINEAR_MIXERS = tuple(name for name, kind in kinds.MIXERS.items() if kind.fixed_state)
FFNS = tuple(kinds.FFNS)


@dataclass
class ModelConfig:
    """Every field of a k3 model. Lists are per layer; presets build them (`k3.models.presets`)."""

    name: str = "custom"
    vocab_size: int = 50304
    hidden_size: int = 768
    num_layers: int = 12
    layer_types: list[str] = field(default_factory=lambda: ["mha"] * 12)
    mlp_types: list[str] = field(default_factory=lambda: ["dense"] * 12)
    # GPT-2 style: LayerNorm, learned positions, tied head; otherwise RMSNorm, no positions, untied
    norm: str = "rmsnorm"  # "rmsnorm" | "layernorm"
    norm_eps: float = 1e-6
    max_position_embeddings: int | None = None  # learned positions (GPT-2) when set
    tie_word_embeddings: bool = False

    # softmax attention (mha) and MLA heads
    num_heads: int = 12
    # linear family (linear_attn, deltanet, gated_deltanet, kda)
    linear_num_heads: int = 12
    linear_head_dim: int = 64
    conv_size: int = 4
    kda_gate: str = "kimi_linear"  # "kimi_linear" | "safe" (K3: g = lower_bound sigmoid(.))
    kda_gate_lower_bound: float = -5.0  # the safe gate's floor (K3's `gate_lower_bound`: -5)
    linear_output_gate: str | None = "low_rank"  # None | "low_rank" | "full" (K3)
    chunk_size: int = 32  # the delta family's chunk: on CPU 32 trains and prefills faster than 64 (k3 bench ops)
    # MLA
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_output_gate: bool = False  # gated MLA (K3)
    rope_theta: float | None = None  # None: NoPE (Kimi Linear, K3)

    # feed-forward
    ffn_activation: str = "swiglu"  # "gelu" (GPT-2) | "swiglu" | "situ" (K3)
    intermediate_size: int = 3072  # dense FFN width
    situ_beta: float = 4.0
    situ_linear_beta: float | None = 25.0
    # mixture of experts
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    moe_latent_size: int | None = None  # K3's latent MoE
    routed_scaling_factor: float = 1.0
    moe_renormalize: bool = True  # top-k weights divided by their sum (when k > 1), as K3 and DeepSeek-V3 do
    # Block Attention Residuals (K3): a new depth source every `attn_res_block_size` layers
    attn_res_block_size: int | None = None

    def __post_init__(self):
        for name in ("layer_types", "mlp_types"):  # a tuple is a list; a string is no list of names
            if isinstance(getattr(self, name), tuple):
                setattr(self, name, list(getattr(self, name)))
        self.validate()

    # -- validation ---------------------------------------------------------------------------------
    def validate(self) -> None:
        def need(ok: bool, what: str, fix: str = "") -> None:
            if not ok:
                raise ValueError(f"ModelConfig({self.name!r}): {what}" + (f"; {fix}" if fix else ""))

        for problem in _type_problems(self):
            need(False, problem)
        for name in ("vocab_size", "hidden_size", "num_layers", "intermediate_size", "chunk_size"):
            need(getattr(self, name) > 0, f"`{name}` must be positive, got {getattr(self, name)}")
        for name in ("norm_eps", "situ_beta", "routed_scaling_factor"):  # finite and > 0 (NaN fails it too)
            need(0 < getattr(self, name) < math.inf, f"`{name}` must be a finite number > 0, got {getattr(self, name)}")
        need(
            self.rope_theta is None or 0 < self.rope_theta < math.inf,
            f"`rope_theta` must be None (no rotary positions) or a finite number > 0, got {self.rope_theta}",
        )
        for name, values in (("layer_types", self.layer_types), ("mlp_types", self.mlp_types)):
            need(
                len(values) == self.num_layers,
                f"`{name}` has {len(values)} entries but `num_layers` is {self.num_layers}",
                "give one entry per layer",
            )
        for t in self.layer_types:
            need(t in MIXERS, f"unknown layer type {t!r} in `layer_types`", f"choose from {MIXERS}")
        for t in self.mlp_types:
            need(t in FFNS, f"unknown FFN type {t!r} in `mlp_types`", f"choose from {FFNS}")
        need(self.norm in ("rmsnorm", "layernorm"), f"`norm` must be 'rmsnorm' or 'layernorm', got {self.norm!r}")
        need(
            self.ffn_activation in ("gelu", "swiglu", "situ"),
            f"`ffn_activation` must be 'gelu', 'swiglu' or 'situ', got {self.ffn_activation!r}",
        )
        need(
            self.kda_gate in ("kimi_linear", "safe"),
            f"`kda_gate` must be 'kimi_linear' or 'safe', got {self.kda_gate!r}",
        )
        need(
            math.isfinite(self.kda_gate_lower_bound) and self.kda_gate_lower_bound < 0,
            f"`kda_gate_lower_bound` must be a finite negative number, got {self.kda_gate_lower_bound}",
        )
        need(
            self.linear_output_gate in (None, "low_rank", "full"),
            f"`linear_output_gate` must be None, 'low_rank' or 'full', got {self.linear_output_gate!r}",
        )
        for name in dict.fromkeys(self.layer_types):
            for problem in kinds.MIXERS[name].check(self):
                need(False, problem)
        for name in dict.fromkeys(self.mlp_types):
            for problem in kinds.FFNS[name].check(self):
                need(False, problem)
        gpt2 = [  # GPT-2's parts, which k3 builds for its softmax attention ('mha') only: (field, value, fix)
            (f"`{name}` {value!r} ({what})", f"`{name}` {fix}")
            for name, value, what, fix, on in (
                ("norm", self.norm, "LayerNorm", "'rmsnorm'", self.norm == "layernorm"),
                ("ffn_activation", self.ffn_activation, "a GELU MLP", "'swiglu'", self.ffn_activation == "gelu"),
                (
                    "max_position_embeddings",
                    self.max_position_embeddings,
                    "learned positions",
                    "null (unset)",
                    bool(self.max_position_embeddings),
                ),
            )
            if on
        ]
        others = sorted(set(self.layer_types) - {"mha"})
        need(
            not (gpt2 and others),
            f"{' and '.join(part for part, _ in gpt2)}: GPT-2's, built for 'mha' layers only, but `layer_types` "
            f"has {', '.join(map(repr, others))}",
            f"give {' and '.join(fix for _, fix in gpt2)}, or start from a gpt2 preset",
        )
        need(
            self.attn_res_block_size is None or self.attn_res_block_size > 0,
            f"`attn_res_block_size` must be None or positive, got {self.attn_res_block_size}",
        )

    # -- convenience --------------------------------------------------------------------------------
    def replace(self, **changes) -> "ModelConfig":
        """A validated copy with some fields changed. To change the depth of a preset, rebuild it
        (`k3.models.get_config(name, num_layers=...)`): the per-layer lists follow the preset's pattern."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        if not isinstance(d, dict):
            raise ValueError(f"ModelConfig.from_dict: expected a dict of ModelConfig fields, got {json_kind(d)}")
        check_field_names(d, "ModelConfig.from_dict")
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Read a Kimi Linear / Kimi K3 `config.json` (the Hub's or transformers' spelling; a nested
        `text_config` is used when present). See `k3.checkpoints.hf_config` for the field mapping."""
        return cls(**fields_from_hf(hf))


def check_field_names(names, where: str) -> None:
    """ValueError naming each of `names` that is no ModelConfig field, with the fields it resembles."""
    fields = [f.name for f in dataclasses.fields(ModelConfig)]
    unknown = [name for name in names if name not in fields]
    if unknown:
        close = {name: difflib.get_close_matches(name, fields, n=2, cutoff=0.6) for name in unknown}
        if all(close.values()):
            hint = "; ".join(f"did you mean {' or '.join(map(repr, c))} for {name!r}?" for name, c in close.items())
        else:
            hint = f"the fields are: {', '.join(fields)}"
        raise ValueError(f"{where}: no ModelConfig field {', '.join(map(repr, unknown))}; {hint}")


_TYPE_NAMES = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "true or false",
    list: "a list (one entry per layer)",
}


def _type_problems(config: ModelConfig) -> list[str]:
    """A line for each field whose value is not of its declared type (a value given as text, say)."""
    problems = []
    for name, hint in _hints().items():
        value = getattr(config, name)
        allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        if value is None and type(None) in allowed:
            continue
        kinds = [typing.get_origin(t) or t for t in allowed if t is not type(None)]
        if not any(_is(value, kind) for kind in kinds):
            expected = " or ".join([_TYPE_NAMES[k] for k in kinds] + (["null"] if type(None) in allowed else []))
            problems.append(f"`{name}` must be {expected}, got {value!r}")
    return problems


@functools.cache
def _hints() -> dict:
    return typing.get_type_hints(ModelConfig)


def _is(value, kind: type) -> bool:
    if kind is float:  # an integer is a number too; a bool is neither
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)
