"""`CausalLM.from_pretrained`: a checkpoint directory -> a model, one tensor at a time.

Reads k3's own checkpoints, Kimi Linear's (the Hub's or transformers' layout, `checkpoint`) and Kimi K3's
published one (`kimi_k3_format`): the model is built on the meta device, given memory (no random
initialisation), and each tensor of each shard is read, renamed and copied into place, so the peak is
about the model plus one tensor. Every parameter must be filled exactly once, with floating-point values
that are all finite; what is missing, unexpected, mis-shaped (config.json's field behind it named), of an
integer dtype or not finite is reported together, naming tensors and files (`fill.Filler`). A file that
is no safetensors file is named (`open_shard`).

Options:
- `dtype`: the model's dtype (MXFP4 experts decode straight to it);
- `experts="mxfp4"`: routed experts stay MXFP4 (`k3.layers.mxfp4_expert`; a checkpoint with unquantized
  experts is encoded on the way in), ~4.25 bits a weight;
- `layers`: decoder-layer indices to keep (in order), for studying a model too large to hold; the
  result is a model of those layers, whose Block AttnRes blocks are counted in the new numbering
  (a prefix `range(n)` keeps the original blocks);
- `device`: where the weights go; "meta" builds the model with no weights at all (nothing is read);
- `strict=False`: integer or bool tensors (cast), NaN and infinity loaded with a warning, and the model
  built with the tensors' sizes where config.json's contradict them (`checkpoint.ConfigMismatch`).

The model's class comes in as `cls` (`CausalLM.from_pretrained` passes itself), and the config's as
`cls.config_class`: this package sits below `k3.models` and imports nothing of it.
"""

from __future__ import annotations

import contextlib
import json
import re
import warnings
from pathlib import Path

import torch

from ..io import CheckpointError, checked_folder, read_json
from ..layers import MoE
from ..layers.mxfp4_expert import MXFP4Expert
from ..runtime import refuse_if_over_memory
from . import checkpoint, dcp, kimi_k3_format
from .fill import Filler

EXPERTS = (None, "mxfp4")
LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")
WEIGHT_FILES = (
    "config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    f"{dcp.SHARDED}/*",
)  # what from_pretrained reads


def shard_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, in order."""
    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    if single.exists():
        return [single]
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as e:
            raise ValueError(f"{index}: not a safetensors index (a JSON object with a `weight_map`): {e}") from None
        missing = [name for name in names if not (directory / name).exists()]
        if missing:
            raise FileNotFoundError(f"{directory}: no {', '.join(missing)} (named by model.safetensors.index.json)")
        return [directory / name for name in names]
    raise FileNotFoundError(f"{directory}: no model.safetensors or model.safetensors.index.json")


@contextlib.contextmanager
def open_shard(file: Path):
    """safetensors' `safe_open(file)`, its errors (a truncated file, a header that is no safetensors header,
    offsets beyond the file) a ValueError naming the file."""
    from safetensors import SafetensorError, safe_open

    if file.exists() and not file.is_file():  # safetensors' own word for a folder: "No such device"
        kind = "a folder" if file.is_dir() else "not a regular file"
        raise ValueError(
            f"{file.parent}: {file.name} is {kind}, not a safetensors file; restore the weights file from the "
            f"run that wrote it"
        )
    try:
        with safe_open(str(file), framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise ValueError(
            f"{file.parent}: {file.name} is damaged or not a safetensors file (truncated, or another format: "
            f"{e}); restore it from the run that wrote it"
        ) from None


def check_same_step(directory: Path) -> None:
    """A k3 training checkpoint's config.json and weights (model.safetensors or dcp/) must come from the
    same save."""
    weights = directory / "model.safetensors"
    if not (directory / "config.json").is_file():
        return  # read_config says what is missing, or what is there instead
    config = read_json(directory / "config.json")
    config_step = config.get("step") if isinstance(config, dict) else None
    if config_step is None:
        return
    if dcp.is_sharded(directory):
        weights_step, source = dcp.sharded_step(directory), f"{dcp.SHARDED}/"
    elif weights.exists():
        with open_shard(weights) as f:
            weights_step, source = (f.metadata() or {}).get("step"), "model.safetensors"
    else:
        return
    if weights_step is not None and int(weights_step) != config_step:
        raise CheckpointError(
            f"{directory}: config.json is from step {config_step} but {source} from step "
            f"{weights_step}: the files come from different saves. Restore the checkpoint from "
            f"a copy"
        )


def subset_config(config: ModelConfig, layers) -> tuple[ModelConfig, dict[int, int]]:
    """The config of decoder layers `layers` (indices into config's) and {old index: new index}."""
    if isinstance(layers, (str, bytes, dict)) or not hasattr(layers, "__iter__"):  # 3: no list of indices
        raise ValueError(
            f"from_pretrained: `layers` must be a list or range of layer indices in [0, {config.num_layers}) "
            f"(e.g. [0, 1] or range(3)), got {layers!r:.60}"
        )
    layers = list(layers)
    bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < config.num_layers]
    if not layers or bad or len(set(layers)) != len(layers):
        raise ValueError(
            f"from_pretrained: `layers` must be distinct layer indices in [0, {config.num_layers}), got {layers}"
        )
    sub = config.replace(
        num_layers=len(layers),
        layer_types=[config.layer_types[i] for i in layers],
        mlp_types=[config.mlp_types[i] for i in layers],
    )
    return sub, {old: new for new, old in enumerate(layers)}


def quantize_experts(model: torch.nn.Module) -> None:
    """Swap every routed expert for an MXFP4Expert of the same shape (on the expert's device)."""
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        for i, expert in enumerate(moe.experts):
            hidden, dim = expert.w1.shape
            with torch.device(expert.w1.device):
                moe.experts[i] = MXFP4Expert(
                    dim, hidden, expert.activation, expert.situ_beta, expert.situ_linear_beta, expert.w1.dtype
                )


def build(cls, config: ModelConfig, dtype: torch.dtype | None, experts: str | None) -> torch.nn.Module:
    """The model on the meta device, in `dtype`, with MXFP4 experts when asked."""
    if experts not in EXPERTS:
        raise ValueError(f"from_pretrained: `experts` must be one of {EXPERTS}, got {experts!r}")
    with torch.device("meta"):
        model = cls(config)
    if experts == "mxfp4":
        quantize_experts(model)
    return model if dtype is None else model.to(dtype)


def _probe(model: torch.nn.Module):
    """`checkpoint.fields_behind`'s probe: (config, layers) -> {tensor: shape} of the model that `config`
    gives with only decoder layers `layers`, built as `model` was (MXFP4 experts or not), on meta."""

    def shapes(config, layers):  # only on a mismatch's path
        experts = "mxfp4" if any(isinstance(m, MXFP4Expert) for m in model.modules()) else None
        built = build(type(model), subset_config(config, layers)[0], None, experts)
        return {k: tuple(t.shape) for k, t in built.state_dict().items()}

    return shapes


def _renumbered(name: str, renumber: dict[int, int] | None) -> str | None:
    """`name` with its decoder-layer index renumbered for a layer subset (None: a layer left out)."""
    m = LAYER_KEY.match(name)
    if renumber is None or m is None:
        return name
    index = int(m.group(1))
    return f"model.layers.{renumber[index]}.{name[m.end() :]}" if index in renumber else None


DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
    "fp64": torch.float64,
    "double": torch.float64,
}


def as_dtype(dtype) -> torch.dtype | None:
    """A model dtype given as a torch.dtype, its name ("bfloat16", "torch.bfloat16") or a usual short name
    ("bf16", "fp32"); None stays None. Anything else is a ValueError listing the names."""
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(
        f"from_pretrained: `dtype` must be a floating torch.dtype or one of {', '.join(DTYPES)}, got {dtype!r}"
    )


def load_pretrained(
    cls,
    path,
    dtype: torch.dtype | None = None,
    *,
    device=None,
    experts: str | None = None,
    layers=None,
    strict: bool = True,
) -> torch.nn.Module:
    """See the module docstring; `cls`: the model class (CausalLM), whose `config_class` (ModelConfig)
    reads config.json."""
    dtype = as_dtype(dtype)
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(
                f"from_pretrained: `device` must be a torch.device or a name such as 'cpu', 'cuda', "
                f"'cuda:1' or 'meta', got {device!r}"
            ) from None
        usable = {"cuda": torch.cuda.is_available, "mps": torch.backends.mps.is_available}.get(device.type)
        if usable is not None and not usable():
            raise ValueError(
                f"from_pretrained: `device` {str(device)!r}, but this PyTorch ({torch.__version__}) cannot use "
                f"{device.type} here; give device='cpu' (or leave it out)"
            )
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"from_pretrained: `device` {str(device)!r}, but this machine has {torch.cuda.device_count()} "
                f"CUDA device(s), numbered from 0"
            )
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(
            f"from_pretrained: {directory} is a file, not a checkpoint folder; give the folder that holds "
            f"config.json and model.safetensors (or shards listed in model.safetensors.index.json)"
        )
    if not directory.is_dir():
        raise FileNotFoundError(
            f"from_pretrained: {directory}: no such folder; a checkpoint folder holds config.json "
            f"and model.safetensors (or shards listed in model.safetensors.index.json), as k3 "
            f"train --out, save_pretrained and k3 export write them"
        )
    # a save still in progress there is finished first; files are checked against k3's manifest
    with checked_folder(directory, WEIGHT_FILES):
        check_same_step(directory)
        config, native = checkpoint.read_config(directory, cls.config_class)
        renumber = None
        if layers is not None:
            config, renumber = subset_config(config, layers)
        model = build(cls, config, dtype, experts)
        if device is not None and torch.device(device).type == "meta":
            return model
        try:
            check_weights(model, directory, native, renumber, strict=strict)
        except checkpoint.ConfigMismatch as e:
            if strict:
                hint = "from_pretrained(..., strict=False) loads it with the tensors' sizes"
                raise checkpoint.ConfigMismatch(f"{e}; {hint}", e.fields, e.explained) from None
            warnings.warn(f"{directory}: {e.explained}: loaded with the tensors' sizes (strict=False)", stacklevel=3)
            config = config.replace(**e.fields)
            model = build(cls, config, dtype, experts)
            check_weights(model, directory, native, renumber, strict=strict)
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        refuse_if_over_memory(
            f"{directory}: loading {config.name!r}",
            nbytes,
            "load it on a machine with more memory, or a subset (layers=...) or experts='mxfp4'",
        )
        allocate(model, device or "cpu")
        filler = Filler(model, str(directory), native, strict, _probe(model))
        skipped = _read_shards(directory, config, native, renumber, filler)
    filler.finish(config.tie_word_embeddings)
    if skipped:
        warnings.warn(
            f"{directory}: skipped {skipped} vision tensors (vision_tower.*, mm_projector.*): k3 loads the text model",
            stacklevel=3,
        )
    return model


def allocate(model: torch.nn.Module, device) -> None:
    """Storage on `device` for a meta-device model's tensors, uninitialised (only what this process holds of
    a sharded one), and a tied head tied again: `to_empty` gives each module its own tensor."""
    model.to_empty(device=device)
    if model.config.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight:
        model.lm_head.weight = model.model.embed_tokens.weight


def load_held(model: torch.nn.Module, path, *, strict: bool = True) -> None:
    """Fill `model`, whose routed experts may be split over processes (the ones held elsewhere None,
    `k3.training.parallel.shard_experts`) and whose tensors may be on the meta device, from the checkpoint
    folder `path`: allocated (on the CPU) and read tensor by tensor, the other processes' experts never
    read. Names, shapes, dtypes and values are checked as in `load_pretrained` (`strict` too)."""
    directory = Path(path)
    with checked_folder(directory, WEIGHT_FILES):
        check_same_step(directory)
        config, native = checkpoint.read_config(directory, type(model.config))
        if config != model.config:
            raise ValueError(f"{directory}: its config.json describes another model than the one to fill")
        if model.lm_head.weight.is_meta:
            allocate(model, "cpu")
        filler = Filler(model, str(directory), native, strict, _probe(model))
        _read_shards(directory, config, native, None, filler)
    filler.finish(config.tie_word_embeddings)


def check_weights(
    model: torch.nn.Module,
    directory: Path,
    native: bool,
    renumber: dict[int, int] | None = None,
    source: str | None = None,
    *,
    strict: bool = True,
) -> None:
    """The checkpoint's tensors, from the safetensors headers alone (no data read), against `model` on
    the meta device: the same names, shapes and dtypes as the load would find, or the load's ValueError
    (naming `source`, default the folder; a ConfigMismatch when config.json's sizes are what differs),
    before anything is allocated. A damaged file is a ValueError naming it. `strict=False`: dtypes pass
    (the load warns of them)."""
    filler = Filler(model, source or str(directory), native, strict, _probe(model))
    _read_shards(directory, model.config, native, renumber, filler, header_only=True)
    filler.finish(model.config.tie_word_embeddings, values=strict)


SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def _read_shards(
    directory: Path,
    config: ModelConfig,
    native: bool,
    renumber: dict[int, int] | None,
    filler: Filler,
    header_only: bool = False,
) -> int:
    """Every tensor of the checkpoint's shards, one at a time, into `filler` under k3's names (as meta
    tensors of the header's shapes when `header_only`); returns the number of vision tensors skipped."""
    if dcp.is_sharded(directory):
        _read_sharded(directory, renumber, filler, header_only)
        return 0
    skipped = 0
    for file in shard_files(directory):
        filler.file = file.name
        with open_shard(file) as f:
            for key in f.keys():
                if not native and kimi_k3_format.is_vision(key):
                    skipped += 1
                    continue
                # k3's names (k3.hf's under `k3.`), or a Kimi layout: K3's published names first
                name = _renumbered(key.removeprefix("k3.") if native else kimi_k3_format.to_kimi_name(key), renumber)
                if name is None:
                    continue
                if filler.held_elsewhere(name):
                    continue
                if header_only:
                    part = f.get_slice(key)
                    if part.get_dtype() not in SAFETENSORS_DTYPES:
                        raise ValueError(f"{file}: {key} is {part.get_dtype()}, a dtype no k3 model holds")
                    t = torch.empty(part.get_shape(), dtype=SAFETENSORS_DTYPES[part.get_dtype()], device="meta")
                else:
                    t = f.get_tensor(key)
                if native:
                    filler.put(name, t)
                    continue
                if name.endswith("self_attn.A_log"):
                    t = kimi_k3_format.unpad_a_log(t, config.linear_num_heads, key)
                for k3_name, part in checkpoint.convert_kimi_tensor(name, t, config).items():
                    filler.put(k3_name, part)
    return skipped


def _read_sharded(directory: Path, renumber: dict[int, int] | None, filler: Filler, header_only: bool) -> None:
    """`_read_shards` for a sharded checkpoint (`dcp/`, torch.distributed.checkpoint's files, k3's names):
    each model tensor read whole from the shards of every process that saved a part of it, one tensor at
    a time (the peak is the model plus one tensor, as from safetensors)."""
    reader = dcp.sharded_reader(directory)
    filler.file = f"{dcp.SHARDED}/"
    try:
        tensors = reader.read_metadata().state_dict_metadata
    except Exception as e:  # a damaged .metadata: pickle's, torch's or the OS's error
        raise ValueError(
            f"{directory}: {dcp.SHARDED}/.metadata is damaged or not written by "
            f"torch.distributed.checkpoint ({type(e).__name__}: {e}); restore it from the run that wrote "
            f"it"
        ) from None
    for key, meta in tensors.items():
        if not key.startswith(dcp.MODEL_PREFIX):
            continue
        name = _renumbered(key[len(dcp.MODEL_PREFIX) :], renumber)
        if name is None or filler.held_elsewhere(name):
            continue
        if header_only:
            t = torch.empty(meta.size, dtype=meta.properties.dtype, device="meta")
        else:
            t = dcp.read_sharded_tensor(reader, key, meta)
        filler.put(name, t)
