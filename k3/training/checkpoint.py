"""Training checkpoints: one directory holding

    model.safetensors   the weights (k3 names)           config.json   {"k3": model config, "train": run config}
    tokenizer.json      the tokenizer                    trainer_state.pt   optimizer, step, schedule length,
    loss.png            the loss curve                                      RNG states, history

or, written by the processes of `--parallel fsdp|ep` each with its own shards, `dcp/` in place of
model.safetensors and of trainer_state.pt's optimizer tensors (k3.checkpoints.dcp; the save: k3.training.sharded).

A save is all-or-nothing (`k3.io.atomic_write_files`: temporaries, then a journal as the commit
point, then the renames and a manifest of sizes and sha256): a kill at any instant, a full disk or a
library error leaves the previous checkpoint or the new one, never a mix, and the leftovers of an
interrupted save are cleared at the next save or load. Loading checks the files against the manifest
and their steps against each other (checkpoints written before the manifest existed have only the
latter). A checkpoint never holds a NaN or an infinity in its weights.
`CausalLM.from_pretrained(dir)` reads the model part of it.

`check_new_run_folder(out, overwrite)` keeps a new run from destroying anything before it starts: a
folder holding a k3 checkpoint is replaced only with `overwrite` (`k3 train --overwrite`), and a file
that k3 did not write is never replaced (a folder of the user's own files takes a run only where none of
them has a name the run writes). `claim_output(out)` readies `k3 train --out` before the first step: the
folder is created and written to, and `.k3-train.lock` (flock, holding the pid) keeps a second
`k3 train` out of it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import errno
import json
import os
from pathlib import Path

import torch

from ..checkpoints.checkpoint import restore_tied_head, weights_to_save
from ..checkpoints.dcp import SHARDED, is_sharded, sharded_step
from ..io import JOURNAL, MANIFEST, CheckpointError, atomic_write_files, checked_folder, read_json
from ..tokenizer import Tokenizer
from .config import saved_train_config
from .metrics import METRICS_FILE, read_metrics
from .optim import portable_state
from .plot import plot_history

FILES = ("model.safetensors", "config.json", "tokenizer.json", "trainer_state.pt", "loss.png")
SHARDED_FILES = (f"{SHARDED}/.metadata", *FILES[1:])  # and dcp/__R_I.distcp: k3.checkpoints.dcp
LOCK = ".k3-train.lock"

__all__ = [
    "CheckpointError",
    "OutputFolderError",
    "save_training_checkpoint",
    "load_training_checkpoint",
    "claim_output",
]


class OutputFolderError(OSError):
    """`--out` cannot take the run: not a folder, not writable, another `k3 train` is using it, or it holds
    a checkpoint or files that the run would replace."""


# what a run writes in its folder besides FILES (and what k3 leaves there: the lock, the journal, the manifest)
RUN_NAMES = (*FILES, SHARDED, METRICS_FILE, "tensorboard", "wandb")


def holds_checkpoint(folder) -> bool:
    """Whether `folder` holds a k3 training checkpoint (or a save of one that died): its manifest or journal,
    or a config.json with k3's run settings (a checkpoint from before the manifest existed)."""
    folder = Path(folder)
    if (folder / MANIFEST).exists() or (folder / JOURNAL).exists():
        return True
    saved = _saved_config(folder)
    return "k3" in saved and "train" in saved


def check_new_run_folder(out, overwrite: bool = False) -> None:
    """Refuse, before anything is written, a new run's `--out` that holds what the run would replace
    (OutputFolderError naming the ways on): a k3 checkpoint, unless `overwrite`; a file or folder that k3
    did not write under one of the names a run writes (RUN_NAMES), even with `overwrite`."""
    out = Path(out)
    if not out.is_dir():
        return
    if holds_checkpoint(out):
        if overwrite:
            return
        step = _saved_step(out)
        raise OutputFolderError(
            f"--out {out} holds the k3 checkpoint of another run{step}, which a new run would "
            f"replace: continue it with --resume {out}, train into another --out, or give "
            f"--overwrite to replace it"
        )
    theirs = sorted(name for name in RUN_NAMES if os.path.lexists(out / name))
    logged = steps_logged_unsaved(out)
    if logged is not None:  # a run stopped before its first save (killed) wrote it: k3's own
        if not overwrite:
            raise OutputFolderError(
                f"--out {out} holds the metrics.jsonl of a k3 run that stopped before its first checkpoint "
                f"({logged} step{'s' * (logged != 1)} logged, nothing saved, so nothing to resume); give "
                f"--overwrite to start a new run there (replacing it), or train into another --out"
            )
        theirs.remove(METRICS_FILE)
    if theirs:
        raise OutputFolderError(
            f"--out {out} holds {', '.join(theirs)}, which k3 did not write and the run would "
            f"replace: move {'them' if len(theirs) > 1 else 'it'} or train into another --out "
            f"(--overwrite replaces only a k3 checkpoint)"
        )


def steps_logged_unsaved(folder) -> int | None:
    """The steps logged in `folder`'s metrics.jsonl when the folder holds no checkpoint and the log is one that
    k3 train wrote (empty, or JSON objects with a "step", a last line maybe cut short by a kill): what a run
    stopped before its first save leaves. None otherwise (no such log, or not k3's)."""
    folder, path = Path(folder), Path(folder) / METRICS_FILE
    if not path.is_file() or holds_checkpoint(folder):
        return None
    try:
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    except (OSError, UnicodeDecodeError):
        return None
    records = read_metrics(path)
    whole = lines[:-1] if lines and not lines[-1].endswith("\n") else lines  # (a last line cut short by a kill)
    if len(records) != len(whole) or not all(isinstance(r.get("step"), int) for r in records):
        return None
    return len({r["step"] for r in records})


def refuse_resuming_unsaved(folder) -> None:
    """FileNotFoundError naming what happened when `folder` holds only what a run stopped before its first save
    left (`steps_logged_unsaved`): there is nothing to resume, and the way on is a new run there."""
    logged = steps_logged_unsaved(folder)
    if logged is not None:
        raise FileNotFoundError(
            f"--resume {folder}: the run there stopped before its first checkpoint ({logged} step"
            f"{'s' * (logged != 1)} logged in metrics.jsonl, nothing saved), so there is nothing to resume; start "
            f"it again with --out {folder} --overwrite"
        )


def _saved_config(folder: Path) -> dict:
    """The folder's config.json as a dict ({} when there is none, or it is not a JSON object)."""
    try:
        saved = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def _saved_step(folder: Path) -> str:
    """ " (at step N)" from the folder's config.json (nothing when it does not say)."""
    step = _saved_config(folder).get("step")
    return f" (at step {step})" if isinstance(step, int) else ""


def save_training_checkpoint(
    out,
    model,
    optimizer,
    tokenizer,
    cfg,
    step: int,
    max_steps: int | None,
    generator: torch.Generator,
    history: dict,
    *,
    weights: dict | None = None,
    optimizer_state: dict | None = None,
    corpus: str | None = None,
) -> None:
    """Write the checkpoint directory `out` whole, or raise CheckpointError and leave it as it was.
    `weights` and `optimizer_state` stand for the model's and optimizer's own state dicts when those
    are not on the CPU (k3.training.checkpointer copies them there); `corpus` is the token streams'
    fingerprint (`TokenData.fingerprint`), checked at resume."""
    from safetensors.torch import save_file

    out = Path(out)
    state = weights_to_save(model, weights)
    optimizer_state = portable_state(optimizer.state_dict() if optimizer_state is None else optimizer_state)
    writers = {
        "model.safetensors": lambda p: save_file(state, p, metadata={"format": "pt", "step": str(step)}),
        **_run_files(model, tokenizer, cfg, step, max_steps, generator, history, optimizer_state, corpus),
    }
    refuse_non_finite(first_non_finite(state), out, step)
    with saving(out):
        atomic_write_files(out, writers, step=step, manifest=True)


def recorded_settings(cfg) -> dict:
    """The run's settings as config.json records them: `data` as an absolute path, so that a resume from
    another working directory reads the same corpus."""
    fields = dataclasses.asdict(cfg)
    if fields["data"] is not None:
        fields["data"] = str(Path(fields["data"]).resolve())
    return fields


def _run_files(
    model,
    tokenizer,
    cfg,
    step: int,
    max_steps: int | None,
    generator: torch.Generator,
    history: dict,
    optimizer_state: dict,
    corpus: str | None = None,
) -> dict:
    """The writers of a checkpoint's files other than the weights, holding the run's state as it is now (the
    random states, a copy of the history): an asynchronous save writes them after the training went on."""
    data_rng, torch_rng, history = generator.get_state(), torch.get_rng_state(), copy.deepcopy(history)
    return {
        "config.json": lambda p: Path(p).write_text(
            json.dumps({"k3": model.config.to_dict(), "train": recorded_settings(cfg), "step": step}, indent=2)
        ),
        "tokenizer.json": tokenizer.save,
        "trainer_state.pt": lambda p: torch.save(
            {
                "optimizer": optimizer_state,
                "step": step,
                "max_steps": max_steps,
                "data_rng": data_rng,
                "torch_rng": torch_rng,
                "history": history,
                "corpus": corpus,
            },
            p,
        ),
        "loss.png": lambda p: plot_history(history, p, title=f"{model.config.name}, step {step}"),
    }


def sharded_run_files(
    model,
    tokenizer,
    cfg,
    step: int,
    max_steps: int | None,
    generator: torch.Generator,
    history: dict,
    param_groups: list[dict],
    corpus: str | None = None,
) -> dict:
    """The writers of a sharded checkpoint's files besides `dcp/` (k3.training.sharded), written by the
    main process: the optimizer's groups (hyperparameters, parameter names in the single-process
    order) stand in trainer_state.pt for its state dict, whose tensors are in `dcp/`."""
    optimizer_state = {"param_groups": param_groups, "sharded": SHARDED}
    return _run_files(model, tokenizer, cfg, step, max_steps, generator, history, optimizer_state, corpus)


@contextlib.contextmanager
def saving(out: Path):
    """Report a failed save as CheckpointError (a full disk reaches us as OSError, SafetensorError or
    torch's RuntimeError), saying that the previous checkpoint is intact."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:
        detail = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"
        if _short_write(e) and "No space left on device" not in detail:
            detail = f"No space left on device (a write came out short: {detail})"
        raise CheckpointError(
            f"could not save the checkpoint to {out}: {detail}; the previous checkpoint there (if any) is intact"
        ) from e


# what torch's file writer says when a write comes out short, as on a full disk (it keeps no errno)
_SHORT_WRITE = ("unexpected pos", "file write failed", "No space left on device")


def _short_write(e: BaseException) -> bool:
    """Whether `e`, or an exception it was raised from (DCP wraps each process's failure), is a full
    disk: ENOSPC, or torch's writer reporting a short write."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or any(w in str(e) for w in _SHORT_WRITE):
            return True
        e = e.__cause__ or e.__context__
    return False


def first_non_finite(state: dict) -> str | None:
    """The name of the first floating-point tensor of `state` (this process's part of a sharded one)
    holding a NaN or an infinity, else None."""
    for name, t in state.items():
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.is_floating_point() and not torch.isfinite(t).all():
            return name
    return None


def refuse_non_finite(name: str | None, out: Path, step: int) -> None:
    """A checkpoint never holds a NaN or an infinity: CheckpointError naming the tensor `name` (None: none)."""
    if name is not None:
        raise CheckpointError(
            f"not saving the checkpoint of step {step} to {out}: {name} holds NaN or "
            f"infinite values; the previous checkpoint there (if any) is intact"
        )


def load_training_checkpoint(path, share: tuple[int, int] = (0, 1)) -> dict:
    """Everything `train` needs to continue: configs, weights, optimizer, RNG states, history. A
    checkpoint whose files disagree (with its manifest, or in their steps) raises CheckpointError.
    A sharded checkpoint's tensors stay on disk: "model" and the optimizer's state are None, and
    "sharded" is the folder to read them from (`Checkpointer.load`). `share` (rank, processes):
    each process of a torchrun job hashes its share of the files against the manifest (the others
    by size)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    refuse_resuming_unsaved(path)
    with checked_folder(path, share=share) as manifest:
        sharded = is_sharded(path)
        expected = SHARDED_FILES if sharded else FILES
        missing = [f for f in expected[:4] if not (path / f).exists()]
        if missing:
            raise FileNotFoundError(f"--resume {path}: not a k3 training checkpoint (missing {', '.join(missing)})")
        config = read_json(path / "config.json")
        state = torch.load(path / "trainer_state.pt", weights_only=True)
        if sharded:
            weights_step, weights = sharded_step(path), None
        else:
            with safe_open(path / "model.safetensors", "pt") as weights_file:
                weights_step = (weights_file.metadata() or {}).get("step")
            weights = load_file(path / "model.safetensors")
        tokenizer = Tokenizer.load(path / "tokenizer.json")
    weights_file = f"{SHARDED}/" if sharded else "model.safetensors"
    steps = {
        "config.json": config.get("step"),
        "trainer_state.pt": state.get("step"),
        weights_file: None if weights_step is None else int(weights_step),
    }
    if manifest is not None and manifest.get("step") is not None:
        steps[".k3-manifest.json"] = manifest["step"]
    known = {name: s for name, s in steps.items() if s is not None}
    if len(set(known.values())) > 1:
        raise CheckpointError(
            f"{path}: its files come from different saves ("
            + ", ".join(f"{name} at step {s}" for name, s in known.items())
            + "); resuming would not continue either run. Restore the checkpoint from a copy"
        )
    if weights is not None:
        weights = restore_tied_head(weights, bool(config["k3"].get("tie_word_embeddings")))
    return {
        **state,
        "train_config": saved_train_config(config["train"]),
        "model": weights,
        "tokenizer": tokenizer,
        "sharded": path if sharded else None,
    }


class claim_output:
    """Ready the output folder `out` of a run and hold it until `release()` (or the end of a `with`):
    create it, check that files can be written in it, and take `.k3-train.lock` (an exclusive flock,
    the file holding this process's pid). A second `k3 train` on the folder gets OutputFolderError
    naming the first one's pid; the kernel drops the lock of a process that dies, so a lock file left
    by a killed run does not block. The folders it created are removed again at `release()` if they are
    still empty then: a run refused before its first save (a missing corpus, a model too big) leaves
    nothing behind."""

    def __init__(self, out):
        self.out, self.path, self.fd = Path(out), Path(out) / LOCK, None
        if self.out.exists() and not self.out.is_dir():
            raise OutputFolderError(
                f"--out {self.out}: is a file, expected a folder for the checkpoint; choose another --out"
            )
        self.created = [p for p in (self.out, *self.out.parents) if not p.exists()]  # innermost first
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            while self.fd is None:
                self.fd = self._lock()
        except OSError as e:
            if isinstance(e, OutputFolderError):
                raise
            raise OutputFolderError(
                f"--out {self.out}: cannot write the checkpoint there ({e.strerror or e}); "
                f"choose a writable folder with --out"
            ) from e

    def _lock(self) -> int | None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            import fcntl
        except ImportError:  # Windows: the folder is checked, not locked
            return fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise OutputFolderError(
                f"--out {self.out}: another k3 train (pid {pid}) is writing its checkpoint "
                f"there; wait for it to end, stop it, or choose another --out"
            ) from None
        try:  # the file we locked may have been removed by the run that held it before us: then again
            same = os.path.samestat(os.fstat(fd), os.stat(self.path))
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            return None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return fd

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)  # before the lock goes, so that no one locks a file about to vanish
            os.close(self.fd)
            self.fd = None
        for folder in self.created:
            try:
                folder.rmdir()  # only if empty
            except OSError:
                break
        self.created = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
        return False
