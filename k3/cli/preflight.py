"""Whether a checkpoint folder will load, found out before anything is allocated.

`check_pretrained(path)` reads what `CausalLM.from_pretrained(path)` reads, except the weights' data:
config.json, and the safetensors headers (names, shapes). It refuses, each with a one-line ValueError
that names the folder and the file:

- a damaged weights file (empty, truncated, not safetensors: the header does not cover the file);
- a model whose float32 weights are more than this machine's memory (the estimate in bytes);
- weights of other names or shapes than config.json's model (a config.json from another run), checked
  by the loader's own pass over the headers (`k3.checkpoints.loading.check_weights`, every layout it reads)
  against the model built on the meta device, which holds no data.

`check_checkpoint(path)` also reads a training checkpoint's other files: tokenizer.json, and
trainer_state.pt where there is one (mapped: its tensors are not read).

The tokenizer must fit the model (`check_vocabulary`; `check_pretrained` checks a tokenizer.json where
the folder has one): in a k3 training checkpoint (config.json has the run's "train" record) the two were
made together, so the tokenizer's size is the model's `vocab_size`; in any other folder (an export, a
Hub checkpoint) the model's vocabulary may be padded past the tokenizer's, but never be smaller (an id
past it has no embedding). Before, a smaller tokenizer generated garbage without a word, and a larger
one was refused only at the first token out of range.

Both read the folder as every reader does (`k3.io.reading`): under its lock, after finishing a save
that died after its commit point, so a checkpoint interrupted there is checked as the save left it
whole, not as a mix of two saves.

`CausalLM.from_pretrained` makes the same header pass and memory check itself; this module adds the
CLI's wording and a training checkpoint's other files. It sits in the CLI, its one user, because it puts
together the model (`CausalLM` on the meta device), its parameter count (`k3.models.params`) and the
checkpoint's reading (`k3.checkpoints`), which lies below the models.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path

import torch

from ..checkpoints.checkpoint import read_config
from ..checkpoints.loading import check_weights
from ..io import check_manifest, read_json, reading
from ..models import CausalLM, ModelConfig
from ..models.params import refuse_if_too_big
from ..tokenizer import Tokenizer


def check_pretrained(path: str | os.PathLike, what: str | None = None) -> ModelConfig:
    """The folder's ModelConfig, once its files are known to load (see the module); `what` names the
    folder in errors (e.g. "--checkpoint runs/k3")."""
    if not str(path).strip():  # Path("") is the current folder
        raise ValueError(
            f"{(what or 'checkpoint').strip()} '': an empty path; give a checkpoint folder (e.g. k3 train --out)"
        )
    directory = Path(path)
    what = what or str(directory)
    if not directory.is_dir():
        found = "is a file, not a checkpoint folder" if directory.exists() else "no such folder"
        raise FileNotFoundError(
            f"{what}: {found} (expected a checkpoint folder, with config.json and model.safetensors: "
            f"e.g. k3 train --out)"
        )
    with reading(directory):  # a save that died after its commit point is finished first
        config, native = read_config(directory, ModelConfig)  # a config.json that is not JSON: a ValueError naming it
        refuse_if_too_big(config, 4, f"{what}: loading", "this checkpoint needs a machine with more memory")
        with torch.device("meta"):
            model = CausalLM(config)
        check_weights(model, directory, native, source=what)
        if (directory / "tokenizer.json").is_file():
            check_vocabulary(directory, config, Tokenizer.load(directory), what)
    return config


def check_vocabulary(directory: Path, config: ModelConfig, tokenizer: Tokenizer, what: str) -> None:
    """ValueError naming the folder when `tokenizer` does not fit the model of `config` (the module):
    its size (the highest id + 1) equal to `vocab_size` in a k3 training checkpoint, at most it elsewhere."""
    size = max(tokenizer.inner.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    training = "train" in read_json(directory / "config.json")
    if size == config.vocab_size or (size < config.vocab_size and not training):
        return
    if training:
        raise ValueError(
            f"{what}: tokenizer.json has {size:,} tokens but the model's vocab_size (config.json) is "
            f"{config.vocab_size:,}; a k3 run trains the two together, so this tokenizer.json is another run's: "
            f"restore the one the run wrote"
        )
    raise ValueError(
        f"{what}: tokenizer.json has {size:,} tokens, more than the model's vocab_size of {config.vocab_size:,} "
        f"(config.json): ids from {config.vocab_size:,} on have no embedding; use the tokenizer that came with "
        f"the model"
    )


def check_checkpoint(path: str | os.PathLike, what: str | None = None) -> ModelConfig:
    """`check_pretrained`, with every file checked against the folder's manifest (where there is one),
    and the folder's tokenizer.json and trainer_state.pt (where there is one) read: a folder written by
    `k3 train` that can be resumed, generated from or inspected."""
    what = what or str(path)
    config = check_pretrained(path, what)
    with reading(path):
        if not (Path(path) / "tokenizer.json").is_file():  # (one is checked against the model above)
            Tokenizer.load(path)  # its error: none there, or a folder of that name
        state = Path(path) / "trainer_state.pt"
        if state.exists():
            try:
                if not zipfile.is_zipfile(state):
                    raise RuntimeError("not a zip archive, which torch.save writes")
                torch.load(state, weights_only=True, mmap=True)
            except (RuntimeError, pickle.UnpicklingError, EOFError) as e:
                raise ValueError(
                    f"{what}: trainer_state.pt is damaged or not written by k3 train "
                    f"({str(e).splitlines()[0]}); restore it from the run that wrote it"
                ) from None
        check_manifest(path)  # last: a file that reads but is not the one the save wrote (the checks above name worse)
    return config


def check_docs_folder(docs: str, flag: str = "--docs") -> None:
    """`k3 lab`'s output folder, before any experiment runs: it and the folders it gets (lab/, figures/)
    must be folders or not exist yet, and it must be possible to make them (ValueError naming `flag`)."""
    for path in (Path(docs), Path(docs) / "lab", Path(docs) / "figures"):
        if os.path.lexists(path) and not path.is_dir():
            raise ValueError(f"{flag} {docs}: {path} exists and is not a folder; choose another {flag}")
    try:
        Path(docs).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag} {docs}: cannot make the folder ({e.strerror})") from e
    if not os.access(docs, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {docs}: the folder cannot be written; choose another {flag}")
