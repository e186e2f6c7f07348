"""Weights in and out: k3's own checkpoints and Hugging Face Kimi Linear / Kimi K3 checkpoints.

A directory with `config.json` and `model.safetensors` (or shards listed in
`model.safetensors.index.json`). k3 writes its config under the key "k3" (so does k3.hf's K3Config,
whose weights carry the prefix `k3.`); anything else is read as a Kimi `config.json`
(`ModelConfig.from_hf`). `k3.checkpoints.loading` reads the tensors one at a time with the mappings here;
Kimi K3's published layout (`language_model.` and K3's own names) is `k3.checkpoints.kimi_k3_format`'s.
Kimi Linear weights come in two layouts, both mapped to k3's names here:

- the Hub's (also what transformers' save_pretrained writes): k3's names except
  `...experts.N.w{1,2,3}.weight` (k3: `experts.N.w{1,2,3}`) and a dense first layer that transformers
  saves under `block_sparse_moe.` (k3: `mlp.`);
- transformers' in-memory one: one depthwise conv over q|k|v (`self_attn.conv1d.weight` [3D, 1, W]),
  the gate under `self_attn.forget_gate.`, MoE under `mlp.` with experts fused into
  `experts.gate_up_proj` [E, 2h, d] and `experts.down_proj` [E, d, h].
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

import torch

from ..io import CheckpointError, atomic_write_files, read_json
from .hf_config import json_kind


def _layer_ffn(config: ModelConfig, key: str) -> str | None:
    m = re.match(r"model\.layers\.(\d+)\.", key)
    return config.mlp_types[int(m.group(1))] if m and int(m.group(1)) < config.num_layers else None


def convert_kimi_state_dict(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Map a Kimi checkpoint's tensors (either layout above) to k3's parameter names."""
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        out.update(convert_kimi_tensor(key, t, config))
    return out


def kimi_tensor_name(key: str, config: ModelConfig) -> str:
    """The k3 name of a Kimi checkpoint tensor that maps one to one (everything but the fused tensors of
    transformers' in-memory layout, which `convert_kimi_tensor` splits)."""
    ffn = _layer_ffn(config, key)
    key = key.replace("self_attn.forget_gate.", "self_attn.")
    if ffn == "moe":
        key = key.replace(".mlp.", ".block_sparse_moe.")
    elif ffn == "dense":
        key = key.replace(".block_sparse_moe.", ".mlp.")
    return re.sub(r"(experts\.\d+\.w[123])\.weight$", r"\1", key)


def convert_kimi_tensor(key: str, t: torch.Tensor, config: ModelConfig) -> dict[str, torch.Tensor]:
    """One Kimi checkpoint tensor -> {k3 name: tensor}: one entry, or several for a fused tensor."""
    if key.endswith("self_attn.conv1d.weight"):  # transformers: fused q|k|v short convolution
        prefix = key[: -len("conv1d.weight")]
        return {f"{prefix}{name}_conv1d.weight": part for name, part in zip(("q", "k", "v"), t.chunk(3, dim=0))}
    key = kimi_tensor_name(key, config)
    if key.endswith("experts.gate_up_proj"):  # transformers: [E, 2h, d], gate rows then up rows
        prefix = key[: -len("gate_up_proj")]
        gate, up = t.chunk(2, dim=1)
        out = {}
        for e in range(t.shape[0]):
            out[f"{prefix}{e}.w1"], out[f"{prefix}{e}.w3"] = gate[e], up[e]
        return out
    if key.endswith("experts.down_proj"):  # transformers: [E, d, h]
        prefix = key[: -len("down_proj")]
        return {f"{prefix}{e}.w2": w2 for e, w2 in enumerate(t)}
    return {key: t}


def kimi_state_dict(model) -> dict[str, torch.Tensor]:
    """The inverse of convert_kimi_state_dict, to the Hub's layout: k3's tensors as they go to disk
    (weights_to_save), routed experts renamed `experts.N.w{1,2,3}` -> `experts.N.w{1,2,3}.weight`.
    Whether Kimi Linear's code computes the same model is `hf_config.kimi_linear_config`'s question."""
    return {re.sub(r"(experts\.\d+\.w[123])$", r"\1.weight", k): t for k, t in weights_to_save(model).items()}


def weights_to_save(model, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The model's tensors (or `state`, its state dict gathered from several processes) as they go to
    disk: contiguous, and a tied head stored once (as the embedding)."""
    state = {k: v.detach().contiguous() for k, v in (model.state_dict() if state is None else state).items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def restore_tied_head(state: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """Undo `weights_to_save` for a tied head: lm_head.weight is the embedding."""
    if tied and "model.embed_tokens.weight" in state:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    return state


def read_config(directory: Path, config_class) -> tuple[ModelConfig, bool]:
    """(config, is_k3_checkpoint) from directory/config.json; `config_class`: the config's class
    (k3.models.ModelConfig, `CausalLM.config_class`), with its `from_dict` and `from_hf`."""
    path = directory / "config.json"
    if not path.exists():
        raise FileNotFoundError(
            f"{directory}: no config.json (expected a checkpoint folder: config.json and "
            f"model.safetensors, or shards listed in model.safetensors.index.json)"
        )
    if not path.is_file():
        raise ValueError(f"{path} is {'a folder' if path.is_dir() else 'not a regular file'}, not a JSON file")
    return config_from_json(path, config_class)


def config_from_json(path: Path, config_class) -> tuple[ModelConfig, bool]:
    """(config, is_k3_checkpoint) from the config.json file `path` (see `read_config`): k3's own under
    "k3" (an object of ModelConfig fields), else a Kimi config.json; a value of the wrong JSON type is a
    ValueError naming the file and the key."""
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object (a model configuration), got {json_kind(raw)}")
    if "k3" in raw:
        if not isinstance(raw["k3"], dict):
            raise ValueError(
                f"{path}: `k3` must be an object (k3's model configuration: ModelConfig's fields, as k3 train "
                f"and save_pretrained write it), got {json_kind(raw['k3'])}"
            )
        return config_class.from_dict(raw["k3"]), True
    return config_class.from_hf(raw), False


def load_into(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str, *, strict: bool = True) -> None:
    """Load with an error that lists what is missing, unexpected or mis-shaped, then what holds integer or
    bool values where the model holds floating-point ones, or NaN or infinity (`strict=False`: those two
    loaded anyway, with a warning)."""
    own = model.state_dict()
    shapes = sorted(
        f"{k}: checkpoint {list(state[k].shape)}, model {list(own[k].shape)}"
        for k in set(own) & set(state)
        if state[k].shape != own[k].shape
    )
    raise_mismatch(source, sorted(set(own) - set(state)), sorted(set(state) - set(own)), shapes)
    dtypes = [f"{k}: {dtype_problem(t, own[k])}" for k, t in state.items() if dtype_problem(t, own[k])]
    flags = {k: values_flag(k, t) for k, t in state.items() if not t.is_meta and not dtype_problem(t, own[k])}
    values = [f"{k}: {values_problem(state[k])}" for k in unusable(flags)]
    refuse_values(source, dtypes, values, strict)
    model.load_state_dict(state, strict=True)


def raise_mismatch(
    source: str, missing: list[str], unexpected: list[str], shapes: list[str], fields: dict | None = None
) -> None:
    """The error of a checkpoint that does not fit the model (nothing when all three lists are empty).
    `fields`: the config fields the shape mismatches come from (`fields_behind`), named first; the error
    is then a ConfigMismatch carrying them."""
    if missing or unexpected or shapes:

        def head(items):
            return ", ".join(items[:8]) + (f", ... ({len(items)} in all)" if len(items) > 8 else "")

        explained = "; ".join(
            f"config.json's `{name}` is {ours} but the tensors' is {theirs} ({key} is {list(ck)}, the config makes "
            f"it {list(md)})"
            for name, (_, ours, theirs, key, ck, md) in (fields or {}).items()
        )
        problems = [
            explained,
            f"missing {head(missing)}" if missing else "",
            f"unexpected {head(unexpected)}" if unexpected else "",
            f"shape mismatch {head(shapes)}" if shapes else "",
        ]
        message = f"{source} does not match the model's configuration: " + "; ".join(p for p in problems if p)
        if fields:
            raise ConfigMismatch(message, {field: theirs for field, _, theirs, *_ in fields.values()}, explained)
        raise ValueError(message)


class ConfigMismatch(ValueError):
    """A checkpoint whose tensors have other sizes than its config.json gives: `fields` {ModelConfig field:
    the tensors' value} (`from_pretrained(strict=False)` builds the model with them), `explained` the
    sentence that names them."""

    def __init__(self, message: str, fields: dict[str, int], explained: str = ""):
        super().__init__(message)
        self.fields, self.explained = fields, explained


# ModelConfig fields that size tensors: the candidates for a shape mismatch's cause (`fields_behind`)
SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "max_position_embeddings",
    "intermediate_size",
    "num_heads",
    "linear_num_heads",
    "linear_head_dim",
    "conv_size",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "num_experts",
    "moe_intermediate_size",
    "num_shared_experts",
    "moe_latent_size",
)
LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def fields_behind(config: ModelConfig, read: dict[str, tuple], model: dict[str, tuple], probe, name=str) -> dict:
    """The config fields whose values the checkpoint's tensors contradict: {name(field): (field, config's
    value, the tensors', a tensor, its shape in the checkpoint, its shape by the config)}, `name` giving
    config.json's spelling. `read`: {tensor: shape} of what the checkpoint holds (k3's names), `model`: the
    model's; `probe(config, layers)`: {tensor: shape} of the model `config` gives with decoder layers
    `layers` only (renumbered from 0). A value is a candidate (the checkpoint's size where the model's is
    the field's, or the field times their ratio) when, on a model of one layer of each kind that
    mismatches, more tensors take the checkpoint's shapes than before; the best, up to three fields."""
    wrong = sorted(k for k in read if k in model and tuple(read[k]) != tuple(model[k]))
    reps: dict = {}  # (layer kinds, name without indices) -> a mismatched tensor of that kind
    for key in wrong:
        m = LAYER.match(key)
        i = int(m.group(1)) if m else None
        kinds = (config.layer_types[i], config.mlp_types[i], re.sub(r"\.\d+\.", ".N.", key[m.end() :])) if m else key
        reps.setdefault(kinds, key)
    layers = sorted({int(LAYER.match(k).group(1)) for k in reps.values() if LAYER.match(k)}) or [0]
    new = {old: n for n, old in enumerate(layers)}

    def probe_name(key: str) -> str | None:  # `key` in the probe's numbering; None: a layer it leaves out
        m = LAYER.match(key)
        if m is None:
            return key
        i = int(m.group(1))
        return f"model.layers.{new[i]}.{key[m.end() :]}" if i in new else None

    # the probe's name -> (the tensor's name, its shape in the checkpoint), for every tensor the probe has
    expected = {probe_name(k): (k, tuple(s)) for k, s in read.items() if k in model and probe_name(k)}

    def agreeing(config) -> tuple[set[str], dict]:  # the probe's tensors of the checkpoint's shape, its shapes
        shapes = probe(config, layers)
        return {k for k, (_, s) in expected.items() if tuple(shapes.get(k, ())) == s}, shapes

    found: dict = {}
    agree, shapes = agreeing(config)
    for _ in range(3):
        candidates = set()
        for key in reps.values():  # each kind's tensor, its checkpoint size c against the config's m
            ck, md = tuple(read[key]), tuple(shapes.get(probe_name(key), ()))
            for c, m in zip(ck, md) if len(ck) == len(md) else ():
                for f in SHAPE_FIELDS:
                    v = getattr(config, f)
                    if c != m and isinstance(v, int) and v > 0 and m % v == 0 and c * v % m == 0:
                        candidates.add((f, c * v // m))
        best, best_agree, best_shapes = None, agree, shapes
        for f, value in sorted(candidates):
            try:
                now, now_shapes = agreeing(config.replace(**{f: value}))
            except Exception:  # a value the config or a layer refuses is not the cause
                continue
            if len(now) > len(best_agree):
                best, best_agree, best_shapes = (f, value), now, now_shapes
        if best is None:
            break
        f, value = best
        now_right = {expected[k][0] for k in best_agree - agree}
        shown = next(k for k in model if k in now_right)  # the first in the model's order
        found[f] = (f, getattr(config, f), value, shown, tuple(read[shown]), tuple(model[shown]))
        config, agree, shapes = config.replace(**{f: value}), best_agree, best_shapes
        if len(agree) == len(expected):
            break
    return {name(f): v for f, v in found.items()}


# -- what a tensor must hold, besides its name and shape ----------------------------------------------
E8M0_NAN = 255  # the MXFP4 scale byte that is no number (the OCP MX spec's NaN; k3 decodes it to infinity)


def dtype_problem(t: torch.Tensor, own: torch.Tensor) -> str | None:
    """Why checkpoint tensor `t` cannot fill the model's tensor `own` by its dtype, or None:
    floating-point weights come from floating-point values (an integer or bool tensor is no weight
    k3 writes: cast, it would hold whole numbers or 0 and 1), MXFP4 codes and scales from uint8."""
    if own.is_floating_point() == t.is_floating_point() and (own.is_floating_point() or own.dtype == t.dtype):
        return None
    expected = "floating-point values" if own.is_floating_point() else str(own.dtype).removeprefix("torch.")
    return f"expected {expected}, got {str(t.dtype).removeprefix('torch.')}"


def values_flag(key: str, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """0-dim tensors on t's device (no host sync), all finite exactly when t's values are usable: a
    floating-point tensor's min and max (one reduction, about what the copy that loaded it costs, where
    `isfinite(t).all()` costs many times more on the CPU); for MXFP4 scales (`key` ending in
    `.weight_scale`), one that is infinite when a scale byte is E8M0's NaN. `unusable` reads them."""
    if t.is_floating_point() and t.numel():
        return tuple(torch.aminmax(t if t.dtype.itemsize > 1 else t.to(torch.float16)))  # float8: no aminmax
    if key.endswith(".weight_scale") and t.numel():
        return ((t.amax().float() - E8M0_NAN).reciprocal(),)  # 1 / 0 exactly when a byte is 255
    return ()


def unusable(flags: dict[str, tuple[torch.Tensor, ...]]) -> list[str]:
    """The keys whose `values_flag` holds a value that is not finite: one check and one transfer per device
    and dtype, however many tensors."""
    groups: dict[tuple, tuple[list, list]] = {}
    for key, probes in flags.items():
        for probe in probes:
            keys, values = groups.setdefault((probe.device, probe.dtype), ([], []))
            keys.append(key)
            values.append(probe)
    bad = set()
    for keys, values in groups.values():
        bad.update(k for k, ok in zip(keys, torch.isfinite(torch.stack(values)).tolist()) if not ok)
    return sorted(bad)


def values_problem(t: torch.Tensor) -> str:
    """What `values_flag` refused in `t`, counted (run on refused tensors only)."""
    if not t.is_floating_point():
        return f"{int((t == E8M0_NAN).sum()):,} MXFP4 scales of {E8M0_NAN} (no number), expected finite scales"
    x = t if t.dtype.itemsize > 1 else t.to(torch.float16)
    counts = [(int(torch.isnan(x).sum()), "NaN"), (int(torch.isinf(x).sum()), "infinite")]
    what = " and ".join(f"{n:,} {kind}" for n, kind in counts if n)
    return f"{what} among its {t.numel():,} values, expected finite values"


def refuse_values(source: str, dtypes: list[str], values: list[str], strict: bool, stacklevel: int = 3) -> None:
    """The error (or with `strict=False`, the warning, `stacklevel` frames up) for tensors of the wrong dtype
    or with values that are no number; nothing when both lists are empty."""
    if not dtypes and not values:
        return
    what = "; ".join(dtypes + values)
    if strict:
        raise ValueError(
            f"{source} holds weights no model can use: {what}. from_pretrained(..., strict=False) loads them "
            f"anyway (integers cast to the model's dtype, NaN and infinity as they are)"
        )
    warnings.warn(f"{source}: loaded with strict=False although {what}", stacklevel=stacklevel)


def save_pretrained(model, path: str | os.PathLike) -> None:
    """Write path/model.safetensors and path/config.json (k3 layout) as one set (`k3.io.atomic_write_files`):
    a failure raises CheckpointError and leaves the folder's earlier files as they were."""
    from safetensors.torch import save_file

    state = weights_to_save(model)
    config = json.dumps({"k3": model.config.to_dict()}, indent=2)
    try:
        atomic_write_files(
            path,
            {
                "model.safetensors": lambda tmp: save_file(state, tmp, metadata={"format": "pt"}),
                "config.json": lambda tmp: Path(tmp).write_text(config),
            },
        )
    except CheckpointError:
        raise
    except Exception as e:  # a full disk reaches us as OSError or SafetensorError
        detail = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"
        raise CheckpointError(
            f"could not save the model to {path}: {detail}; the files there before (if any) are intact"
        ) from e
