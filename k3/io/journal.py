"""A set of files made current together through a journal (`atomic_write_files`, `commit_files`,
`move_files_into`, `shared_staging`), and `recover`, which finishes or undoes a save that died: the
protocol of `k3.io`'s docstring."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from .atomic import (
    CheckpointError,
    Writer,
    _held,
    _remove,
    _settle,
    _sync_folder,
    _umask,
    describe,
    folder_lock,
    temp_beside,
    write_json,
)

JOURNAL = ".k3-commit.json"
MANIFEST = ".k3-manifest.json"
_TEMPORARY = re.compile(r"^\..+\.k3-[^.]+\.tmp$")  # the names temp_beside gives
# and those it gave a checkpoint's files before it marked them "k3-" (mkstemp's 8 random characters)
_EARLIER_TEMPORARY = re.compile(
    r"^\.(model\.safetensors|config\.json|tokenizer\.json|trainer_state\.pt|loss\.png)"
    r"\.[a-z0-9_]{8}\.tmp$"
)


def atomic_write_files(
    folder: str | os.PathLike, writers: dict[str, Writer], step: int | None = None, manifest: bool = False
) -> None:
    """Write every file `name` of `writers` in `folder` (created if needed) with writer(tmp_path), and
    make them current together (the journal of the module's docstring). With `manifest` the folder's
    manifest becomes these files (and `step`): a k3 training checkpoint. Without it no manifest is
    started (a folder for other programs, e.g. `save_pretrained`'s), but one already there is updated
    with the new files. A failure while writing removes the temporaries, leaves the folder's files as
    they were and raises the writer's error; a failure after the commit point raises CheckpointError,
    and the new files are put in place at the next read or save."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with folder_lock(folder):
        recover(folder)
        commit_files(folder, writers, step, manifest)


def commit_files(
    folder: str | os.PathLike,
    writers: dict[str, Writer],
    step: int | None = None,
    manifest: bool = False,
    described: dict[str, dict] | None = None,
) -> None:
    """`atomic_write_files` in a folder whose lock the caller holds and which it has recovered
    (`shared_staging`). `described`: {name: {"size", "sha256"}} of files whose writer moves a file
    already hashed (by the process that wrote it) into place; their size is checked, not re-hashed."""
    folder = Path(folder)
    if os.path.realpath(folder) not in _held:
        raise RuntimeError(f"commit_files: the caller must hold the lock of {folder} (k3.io.folder_lock)")
    described = described or {}
    for name in writers:
        if not _inside(name):
            raise ValueError(f"commit_files: file names must be relative to {folder}, got {name!r}")
    temps: dict[str, str] = {}
    try:
        for name, write in writers.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            temps[name] = tmp = temp_beside(folder / name)
            write(tmp)
            _settle(tmp)
        files = {
            name: {"from": os.path.relpath(tmp, folder), **_described(tmp, described.get(name))}
            for name, tmp in temps.items()
        }
        stale = sorted(set(_listed(folder)) - set(files)) if manifest else []
        for sub in {(folder / name).parent for name in files}:
            _sync_folder(sub)
        write_json(
            folder / JOURNAL,
            {
                "step": step,
                "manifest": manifest,
                "files": files,  # the commit point
                "remove": stale,
            },
        )
    except BaseException:
        if (folder / JOURNAL).exists():  # interrupted just after the commit point: the new set stands
            _roll_forward(folder)
        else:
            _remove(temps.values())
        raise
    _roll_forward(folder)


def _described(path: str, known: dict | None) -> dict:
    """{"size", "sha256"} of the file at `path`: `known`'s (its size checked), or hashed now."""
    if known is None:
        return describe(path)
    size = os.path.getsize(path)
    if size != known["size"]:
        raise CheckpointError(f"{path}: {size} bytes, but the process that wrote it counted {known['size']}")
    return {"size": size, "sha256": known["sha256"]}


def _listed(folder: Path) -> list[str]:
    """The files the folder's manifest lists (none without a readable one)."""
    try:
        return list(json.loads((folder / MANIFEST).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return []


@contextlib.contextmanager
def shared_staging(folder: str | os.PathLike) -> Iterator[Path]:
    """For a set of files written by several processes (a sharded checkpoint): `folder` (created if
    needed) locked and recovered, and a new temporary folder inside it for the processes to write
    into, removed with whatever is left in it when the block ends. The lock holder commits the
    files with `commit_files` inside the block; a process that dies before leaves the temporary
    folder to the next `recover`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with folder_lock(folder):
        recover(folder)
        staging = Path(tempfile.mkdtemp(dir=folder, prefix=".staging.k3-", suffix=".tmp"))
        os.chmod(staging, 0o777 & ~_umask())
        try:
            yield staging
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def move_files_into(staging: str | os.PathLike, folder: str | os.PathLike) -> list[str]:
    """Move every file of `staging` into `folder` (created if needed) as one set (`atomic_write_files`),
    with the permissions a plain open() would give; returns their names, sorted."""
    staging = Path(staging)
    names = sorted(p.name for p in staging.iterdir())

    def mover(name: str) -> Writer:
        return lambda tmp: os.replace(staging / name, tmp)

    atomic_write_files(folder, {name: mover(name) for name in names})
    return names


def _roll_forward(folder: Path) -> None:
    """Finish the save that the folder's journal commits: renames, manifest, journal removed."""
    journal_path = folder / JOURNAL
    try:
        journal = json.loads(journal_path.read_text())
        for name, entry in journal["files"].items():
            if os.path.lexists(folder / entry["from"]):
                os.replace(folder / entry["from"], folder / name)
            elif not (folder / name).exists():
                raise CheckpointError(
                    f"{folder}: the journal {JOURNAL} of an interrupted save lists {name}, but "
                    f"neither it nor its temporary {entry['from']} is there; the checkpoint is "
                    f"incomplete (restore it from a copy)"
                )
        for sub in {(folder / name).parent for name in journal["files"]}:
            _sync_folder(sub)
        files = {name: {"size": e["size"], "sha256": e["sha256"]} for name, e in journal["files"].items()}
        if journal["manifest"]:
            write_json(folder / MANIFEST, {"step": journal["step"], "files": files})
        elif (folder / MANIFEST).exists():  # keep an earlier manifest true to the files it lists
            _update_manifest(folder, files)
        _remove_stale(folder, journal.get("remove", []))
        os.unlink(journal_path)
        _sync_folder(folder)
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as e:
        detail = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"
        raise CheckpointError(
            f"{folder}: a save was committed (its journal {JOURNAL} is there) but could not be "
            f"put in place: {detail}. Make the folder writable and load or save it again to "
            f"complete it"
        ) from e


def _inside(name: str) -> bool:
    """Whether the file name `name` stays inside the folder it is relative to."""
    return not Path(name).is_absolute() and ".." not in Path(name).parts


def _remove_stale(folder: Path, names: list[str]) -> None:
    """Remove the previous set's files that the new set lacks, and the subfolders they leave empty."""
    for name in names:
        if not _inside(name):
            continue  # (a journal k3 did not write)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(folder / name)
        with contextlib.suppress(OSError):  # only if empty
            if (folder / name).parent != folder:
                (folder / name).parent.rmdir()


def _update_manifest(folder: Path, files: dict) -> None:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        manifest["files"].update(files)
    except (ValueError, KeyError, TypeError, AttributeError):  # unreadable: it cannot vouch for anything
        os.unlink(folder / MANIFEST)
        return
    write_json(folder / MANIFEST, manifest)


def recover(folder: str | os.PathLike) -> None:
    """Bring `folder` back to one whole set of files after a save that died (the caller holds its lock):
    finish a committed save, or remove the temporaries of an uncommitted one (left in a read-only folder)."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    if (folder / JOURNAL).exists():
        _roll_forward(folder)
    subfolders = []
    for leftover in folder.iterdir():
        temporary = _TEMPORARY.match(leftover.name) or _EARLIER_TEMPORARY.match(leftover.name)
        if temporary and leftover.is_file():
            with contextlib.suppress(OSError):
                leftover.unlink()
        elif temporary and leftover.is_dir() and _TEMPORARY.match(leftover.name):  # shared_staging's
            shutil.rmtree(leftover, ignore_errors=True)
        elif leftover.is_dir() and not leftover.is_symlink():
            subfolders.append(leftover)
    for sub in subfolders:  # the temporaries of files in a subfolder (one level: dcp/)
        with contextlib.suppress(OSError):
            for leftover in sub.iterdir():
                if _TEMPORARY.match(leftover.name) and leftover.is_file():
                    with contextlib.suppress(OSError):
                        leftover.unlink()
