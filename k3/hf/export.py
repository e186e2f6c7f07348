"""`k3 export`: a checkpoint directory (anything `CausalLM.from_pretrained` reads) -> a directory in a
published format.

Three formats:

- "k3" (default, any k3 model): what K3ForCausalLM.save_pretrained writes — config.json with
  model_type "k3" and the k3 ModelConfig under "k3", model.safetensors with k3's names under `k3.`,
  generation_config.json, and transformers' remote code: an `auto_map` in config.json naming
  configuration_k3.py and modeling_k3.py, beside it (`k3.hf.remote_code`: they import k3's classes).
  Loads with AutoModelForCausalLM after `import k3.hf`, or with `trust_remote_code=True` in an
  interpreter that never imported k3 (k3 installed), and with k3's own CausalLM.from_pretrained.
- "kimi-linear" (kimi-linear* models): Kimi Linear's own format — config.json with model_type
  "kimi_linear" in the Hub's spelling (`hf_config.kimi_linear_config`, which refuses what Kimi Linear
  cannot express) and model.safetensors in the Hub's names (`checkpoint.kimi_state_dict`). Loads with
  transformers' KimiLinearForCausalLM (transformers 5), no k3 needed.
- "kimi-k3" (KDA/MLA models): Kimi K3's published layout (`k3.checkpoints.kimi_k3_format`) — config.json
  with `text_config` and the published field names, tensors under `language_model.` with K3's names
  in the published dtypes (float32 for A_log, dt_bias, the short convolutions, o_norm and the router's
  correction bias; bfloat16 for the rest), A_log padded to [head_dim] (with the source's padding when
  it has one), sharded safetensors (`model-0000i-of-0000n.safetensors`) with
  `model.safetensors.index.json`. The routed experts (`quantize`): by default as the checkpoint stores
  them — MXFP4 codes and scales copied byte for byte, full precision written bfloat16 — so a published
  checkpoint read by k3 exports to the same tensors, byte for byte; `quantize="mxfp4"` stores them in
  compressed-tensors MXFP4 (encoding full-precision ones), `quantize="bf16"` in bfloat16 (decoding MXFP4
  ones, exactly).
- "gguf" (Kimi K3 and Kimi Linear models, GPT-2): one file, model.gguf, for llama.cpp (and what runs
  it: llama-cpp-python, ollama, LM Studio) in its own architectures `kimi-k3`, `kimi-linear` and `gpt2`
  (`k3.checkpoints.gguf_format`, which refuses what llama.cpp cannot compute), the matrices in
  `outtype`, MXFP4 routed experts kept MXFP4, the tokenizer inside (llama.cpp's "gpt2" BPE with GPT-2's
  pre-tokenizer) and the checkpoint's chat template when it has one.

The output must be a new or an empty directory: an export never writes over files (a training
checkpoint's config.json and model.safetensors have the names an export writes), so an existing
non-empty `out`, the checkpoint itself, a folder inside it or one holding it are refused before anything
is read (FileExistsError / ValueError: `k3 export` says so in one line, exit 2), and checked again, under
the folder's lock, just before the files are moved in.

When the checkpoint has a tokenizer.json (k3 train writes one), it is copied with a
tokenizer_config.json naming PreTrainedTokenizerFast (transformers' own class, no remote code), and the
config's bos/eos token is <|endoftext|>. `AutoTokenizer.from_pretrained(dir)` loads the Kimi Linear and
Kimi K3 formats with no flag and no prompt. It reads config.json first, through AutoConfig: for the k3
format, whose model_type "k3" transformers resolves only through the remote code of config.json's
auto_map, it needs what the model needs — `import k3.hf` first or `trust_remote_code=True` — or it
asks whether to run that code (transformers 5.24); for Kimi K3's model_type "kimi_k3", which this
transformers does not know, it logs "You are using a model of type `kimi_k3` to instantiate a model of
type ``" (its fallback to the base config class) and loads the tokenizer. Every file is written to a
temporary folder beside the output first and moved into place once all are complete (`k3.io`).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Iterator

from ..io import CheckpointError, folder_lock, move_files_into, reading, staging_folder

FORMATS = ("k3", "kimi-linear", "kimi-k3", "gguf")
QUANTIZE = (None, "mxfp4", "bf16")  # kimi-k3's routed experts: as stored, MXFP4, bfloat16
MAX_SHARD_BYTES = 5 * 10**9  # transformers' default shard size, "5GB"
GGUF_FILE = "model.gguf"


def export(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    format: str = "k3",
    quantize: str | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    outtype: str | None = None,
) -> list[str]:
    """Write `checkpoint` (a k3 training or model checkpoint directory, or any checkpoint
    `CausalLM.from_pretrained` reads) to `out`, a new or empty directory, in `format`. `quantize`
    (kimi-k3 only) says how the routed experts are stored: None, as the checkpoint stores them (MXFP4
    stays MXFP4, byte for byte); "mxfp4", MXFP4; "bf16", bfloat16. The other formats hold full-precision
    experts (MXFP4 ones are decoded). Returns the names of the files written."""
    from ..checkpoints.gguf_format import OUTTYPES, gguf_architecture, write_gguf
    from ..checkpoints.hf_config import kimi_linear_config
    from ..checkpoints.kimi_k3_format import published_config
    from ..models import CausalLM
    from ..serve.text import load_chat_template
    from ..tokenizer import Tokenizer

    if format not in FORMATS:
        raise ValueError(f"export: `format` must be one of {FORMATS}, got {format!r}")
    if quantize not in QUANTIZE or (quantize and format != "kimi-k3"):
        raise ValueError(
            f"export: `quantize` must be one of {QUANTIZE} (mxfp4 and bf16 with format 'kimi-k3' "
            f"only), got {quantize!r} with format {format!r}"
        )
    if outtype is not None and (format != "gguf" or outtype not in OUTTYPES):
        raise ValueError(
            f"export: `outtype` must be one of {OUTTYPES} with format 'gguf', got {outtype!r} with format {format!r}"
        )
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"export: `max_shard_bytes` must be a positive int, got {max_shard_bytes!r}")
    checkpoint, out = Path(checkpoint), _resolved(out, "out")  # resolved: the staging folder goes beside it
    check_output(checkpoint, out)
    stored_mxfp4, a_log_pad = False, {}
    with reading(checkpoint) if checkpoint.is_dir() else contextlib.nullcontext():  # one whole save, locked
        if format in ("kimi-k3", "gguf") and checkpoint.is_dir():  # (from_pretrained says what a missing folder needs)
            stored_mxfp4, a_log_pad = _stored_layout(checkpoint)
        mxfp4_out = quantize == "mxfp4" or (quantize is None and stored_mxfp4)
        # MXFP4 experts stay MXFP4 in memory (decoded to bfloat16 only as they are written, for "bf16")
        experts = "mxfp4" if format in ("kimi-k3", "gguf") and (mxfp4_out or stored_mxfp4) else None
        model = CausalLM.from_pretrained(checkpoint, experts=experts).eval()
        tokenizer = Tokenizer.load(checkpoint) if (checkpoint / "tokenizer.json").exists() else None
        chat_template = load_chat_template(checkpoint) if format == "gguf" and checkpoint.is_dir() else None
    if format == "gguf":
        gguf_architecture(model.config)  # refused before anything is written
        _require_gguf()
    # Kimi Linear's config.json, made (or refused) before anything is written
    kimi_config = kimi_linear_config(model.config) if format == "kimi-linear" else None
    k3_config = published_config(model.config, mxfp4_out) if format == "kimi-k3" else None
    special = {} if tokenizer is None else dict(bos_token_id=tokenizer.eot_id, eos_token_id=tokenizer.eot_id)
    with staging_folder(out) as staging:
        with writing(out):
            if format == "gguf":
                path = staging / GGUF_FILE
                write_gguf(model, path, outtype or "f32", tokenizer, chat_template, name=checkpoint.name)
                tokenizer = None  # inside the GGUF file
            elif k3_config is not None:
                _write_kimi_k3(model, k3_config, staging, special, mxfp4_out, max_shard_bytes, a_log_pad)
            elif kimi_config is None:
                _write_k3(model, staging, special)
            else:
                _write_kimi_linear(model, kimi_config, staging, special)
            if tokenizer is not None:
                _write_tokenizer(tokenizer, model.config, staging)
        out.mkdir(parents=True, exist_ok=True)
        with folder_lock(out):  # nothing may have appeared there while the files were written
            check_output(checkpoint, out)
            return move_files_into(staging, out)


def _require_gguf() -> None:
    try:
        import gguf  # noqa: F401
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            "export: --format gguf needs the gguf package (llama.cpp's writer): pip install 'k3[gguf]'", name="gguf"
        ) from e


@contextlib.contextmanager
def writing(out: Path) -> Iterator[None]:
    """A failure to write the export's files (a full disk reaches us as OSError, safetensors' SafetensorError or
    torch's RuntimeError) as a CheckpointError naming `out`; the files are written beside it and removed, so
    nothing is left in `out`."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, SafetensorError, RuntimeError) as e:
        detail = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"
        raise CheckpointError(
            f"export: could not write the files for {out}: {detail}; nothing was written there"
        ) from e


def _resolved(path: str | os.PathLike, name: str) -> Path:
    """`path` with its links followed; a symlink loop is a ValueError naming `name` (pathlib's own error
    is a RuntimeError, or an OSError on newer Pythons, that names neither)."""
    try:
        return Path(path).resolve()
    except (RuntimeError, OSError) as e:
        raise ValueError(f"export: `{name}` {path} cannot be resolved: a symbolic link loop ({e})") from e


def check_output(checkpoint: str | os.PathLike, out: str | os.PathLike) -> None:
    """Refuse an export's output directory that could overwrite files: `out` must not exist or be an
    empty directory, and be neither the checkpoint, nor inside it (the export would become part of the
    training run's folder), nor hold it (ValueError for those three, FileExistsError for a file or a
    directory with entries, each naming `out` and what is there)."""
    source, target = _resolved(checkpoint, "checkpoint"), _resolved(out, "out")
    for bad, what in (
        (target == source, "is the checkpoint being exported"),
        (target.is_relative_to(source), f"is inside the checkpoint being exported ({checkpoint})"),
        (source.is_relative_to(target), f"holds the checkpoint being exported ({checkpoint})"),
    ):
        if bad:
            raise ValueError(
                f"export: `out` must be a new or empty directory outside the checkpoint, got {out}, which {what}"
            )
    if os.path.lexists(out) and not Path(out).is_dir():
        raise FileExistsError(
            f"export: `out` must be a new or empty directory, got {out}, which exists and is not a directory"
        )
    entries = sorted(p.name for p in Path(out).iterdir()) if Path(out).is_dir() else []
    if entries:
        shown = ", ".join(entries[:4]) + (f" and {len(entries) - 4} more" if len(entries) > 4 else "")
        raise FileExistsError(
            f"export: `out` must be a new or empty directory, got {out}, which holds {shown}; "
            f"export to another directory, or empty it first"
        )


def _stored_layout(checkpoint: Path) -> tuple[bool, dict]:
    """(does the checkpoint store routed experts in MXFP4, its published A_log tensors' padding by name),
    from the safetensors headers and the A_log tensors alone."""
    import torch
    from safetensors import SafetensorError, safe_open

    from ..checkpoints.checkpoint import read_config
    from ..checkpoints.kimi_k3_format import PREFIX, a_log_padding
    from ..checkpoints.loading import shard_files
    from ..models import ModelConfig

    stored_mxfp4, a_logs = False, {}
    with reading(checkpoint):
        config, _ = read_config(checkpoint, ModelConfig)
        for file in shard_files(checkpoint):
            try:
                with safe_open(str(file), framework="pt") as f:
                    for key in f.keys():
                        stored_mxfp4 |= key.endswith(".weight_packed")
                        if key.startswith(PREFIX) and key.endswith("self_attn.A_log"):
                            a_logs[key] = f.get_tensor(key).to(torch.float32)
            except SafetensorError as e:
                raise ValueError(
                    f"{checkpoint}: {file.name} is damaged or not a safetensors file ({e}); restore it "
                    f"from the run that wrote it"
                ) from None
    return stored_mxfp4, a_log_padding(a_logs, config.linear_num_heads, config.linear_head_dim)


def _write_k3(model, directory: Path, special: dict) -> None:
    from .modeling import K3ForCausalLM

    K3ForCausalLM.from_k3(model, **special).save_pretrained(directory)  # with the remote code


def _write_kimi_linear(model, config: dict, directory: Path, special: dict) -> None:
    from safetensors.torch import save_file

    from ..checkpoints.checkpoint import kimi_state_dict

    dtype = str(model.lm_head.weight.dtype).removeprefix("torch.")
    # pad_token_id explicitly: KimiLinearConfig's default (163839) would be outside a small vocabulary
    import transformers

    ids = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **special}
    config.update({**ids, "dtype": dtype, "transformers_version": transformers.__version__})
    save_file(kimi_state_dict(model), directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def _write_kimi_k3(
    model, config: dict, directory: Path, special: dict, quantize: bool, max_shard_bytes: int, a_log_pad: dict
) -> None:
    """Kimi K3's published layout: shards of at most `max_shard_bytes` (a bigger tensor gets one of its
    own), each tensor made when its shard is written, and the index."""
    from safetensors.torch import save_file

    from ..checkpoints.kimi_k3_format import published_entries

    shards: list[list] = [[]]
    size = 0
    for entry in published_entries(model, quantize, a_log_pad):
        if shards[-1] and size + entry.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({e.name: e.make() for e in shard}, directory / name, metadata={"format": "pt"})
        weight_map.update({e.name: name for e in shard})
    total = sum(e.nbytes for shard in shards for e in shard)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    ids = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **special}
    config.update({"dtype": "bfloat16", **ids})
    config["text_config"].update({"dtype": "bfloat16", **ids})
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def _write_tokenizer(tokenizer, config, directory: Path) -> None:
    """tokenizer.json and a tokenizer_config.json naming transformers' own PreTrainedTokenizerFast, with
    no auto_map (the tokenizer is never remote code, in any format), <|endoftext|> as bos and eos."""
    from ..tokenizer import EOT

    tokenizer.save(directory / "tokenizer.json")
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "clean_up_tokenization_spaces": False,
    }  # decode must give back k3's text exactly
    if config.max_position_embeddings:
        settings["model_max_length"] = config.max_position_embeddings
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
