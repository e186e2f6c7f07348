"""Writing files so that a reader never sees a half-written one, nor a set of files from two saves.

Every file k3 writes (checkpoints, exports, the lab's results and figures, the unpacked corpus) goes
through this module. Files get the permissions a plain `open()` would give under the user's umask.

One file (`atomic_write`, `write_json`): the content is written under a temporary name in the
target's own folder (the same filesystem, so the final `os.replace` is an atomic rename), flushed to
disk and renamed over the target; the temporary is removed if writing fails or is interrupted.

A set of files (`atomic_write_files`, `move_files_into`: a checkpoint, an export) keeps the names
other programs look for (model.safetensors, config.json, ...) side by side in one folder, so no
single rename can swap it. It is committed through a journal:

1. each new file is written under a temporary name beside its target and flushed (fsync);
2. the journal `.k3-commit.json` is written atomically, listing each temporary -> final name with the
   file's size and sha256: its appearance is the commit point;
3. the temporaries are renamed into place, the manifest `.k3-manifest.json` (the names, sizes and
   hashes, and the checkpoint's step) is written atomically, and the journal is removed. Training
   checkpoints start a manifest; sets written for other programs (`save_pretrained`, an export) do
   not, but keep one already in the folder true to its files. A training checkpoint's manifest is its
   whole set: the files of the previous set that the new one lacks (a whole model.safetensors replaced
   by sharded files, the shards of a save by more processes) are removed at the commit, after the
   renames; only files a manifest listed are ever removed.

A name may lie in a subfolder (`dcp/__0_0.distcp`: the files of torch.distributed.checkpoint, one or
more a process): its temporary is written beside it there. Files written by several processes go
through `shared_staging(folder)`: the folder is locked and recovered, the processes write into a
temporary folder inside it, and the lock holder commits them with `commit_files`, moving each file
(already hashed by the process that wrote it: `described`) into place under the same journal.

The next writer and every reader (through `reading`: every command and loader, their checks included)
first `recover` the folder: a journal means a save died after its commit point, and its renames are
finished (roll forward); without one, the temporaries of a save that died before it are removed. A
kill at any instant therefore leaves the previous set or the new one, never a mix. Readers then
compare the files they read with the manifest (`checked_folder`) and refuse one that differs, naming
it; a folder without a manifest (written before it existed, or by another program) is read as it is.

Writers and readers of one folder take turns through a lock on the folder itself (`folder_lock`:
fcntl.flock of the directory, so no lock file, and it works in a read-only folder), reentrant within
a process: a reader never recovers a folder while a live process is saving into it.

- `staging_folder(beside)`: a fresh temporary folder beside a target, for writers that produce a
  whole folder (transformers' `save_pretrained`, an unpacked archive); removed on exit.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Iterator

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; the journal still makes a save all-or-nothing
    fcntl = None

Writer = Callable[[str], object]  # writes the file at the path it is given

JOURNAL = ".k3-commit.json"
MANIFEST = ".k3-manifest.json"
_TEMPORARY = re.compile(r"^\..+\.k3-[^.]+\.tmp$")  # the names temp_beside gives
# and those it gave a checkpoint's files before it marked them "k3-" (mkstemp's 8 random characters)
_EARLIER_TEMPORARY = re.compile(r"^\.(model\.safetensors|config\.json|tokenizer\.json|trainer_state\.pt|loss\.png)"
                                r"\.[a-z0-9_]{8}\.tmp$")


class CheckpointError(OSError):
    """A set of files could not be written or read whole; the message names them and what is left on disk."""


def _umask() -> int:
    os.umask(umask := os.umask(0))
    return umask


def file_mode() -> int:
    """The permissions `open()` gives a new file under the current umask."""
    return 0o666 & ~_umask()


def temp_beside(path: str | os.PathLike) -> str:
    """A new empty temporary file in path's folder, with open()'s permissions (mkstemp's are owner-only)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.k3-", suffix=".tmp")
    os.close(fd)
    os.chmod(tmp, file_mode())
    return tmp


def _fsync(path: str | os.PathLike) -> None:
    """Flush a file's data, or a folder's entries (renames), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _settle(path: str | os.PathLike) -> None:
    """Give a written file open()'s permissions (safetensors makes it owner-only) and flush it to disk."""
    os.chmod(path, file_mode())
    _fsync(path)


def _sync_folder(folder: Path) -> None:
    """Flush the folder's entries (renames) to disk, where the filesystem allows it."""
    with contextlib.suppress(OSError):
        _fsync(folder)


def _remove(paths: Iterable) -> None:
    for tmp in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


_held: dict[str, list] = {}  # folder -> [fd or None, depth]: the locks this process holds


@contextlib.contextmanager
def folder_lock(folder: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive lock on `folder` (flock of the directory) while the block runs; reentrant
    within the process. Without a folder, or where the filesystem has no locks, it does nothing."""
    key = os.path.realpath(folder)
    if key in _held:
        _held[key][1] += 1
        try:
            yield
        finally:
            _held[key][1] -= 1
        return
    fd = None
    if fcntl is not None and os.path.isdir(key):
        try:
            fd = os.open(key, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            if fd is not None:
                os.close(fd)
            fd = None
    _held[key] = [fd, 1]
    try:
        yield
    finally:
        del _held[key]
        if fd is not None:
            os.close(fd)  # releases the lock


def atomic_write(path: str | os.PathLike, write: Writer) -> None:
    """write(tmp_path) on a temporary beside `path`, renamed over it: readers see the old file or the new one."""
    with folder_lock(Path(path).parent):
        tmp = temp_beside(path)
        try:
            write(tmp)
            _settle(tmp)
            os.replace(tmp, path)
        except BaseException:
            _remove([tmp])
            raise


def write_json(path: str | os.PathLike, obj, indent: int = 1) -> None:
    """`obj` as JSON at `path`, atomically."""
    atomic_write(path, lambda tmp, text=json.dumps(obj, indent=indent): Path(tmp).write_text(text))


def read_json(path: str | os.PathLike):
    """The JSON value in the file `path`; one that is not UTF-8 JSON: a ValueError naming it and where it breaks."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); fix the file or "
                         f"restore it from a copy") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}), so not a "
                         f"JSON file; restore it from a copy") from None


def describe(path: str | os.PathLike) -> dict:
    """{"size": bytes, "sha256": hex digest} of a file."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            sha.update(block)
    return {"size": os.path.getsize(path), "sha256": sha.hexdigest()}


def atomic_write_files(folder: str | os.PathLike, writers: dict[str, Writer], step: int | None = None,
                       manifest: bool = False) -> None:
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


def commit_files(folder: str | os.PathLike, writers: dict[str, Writer], step: int | None = None,
                 manifest: bool = False, described: dict[str, dict] | None = None) -> None:
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
        files = {name: {"from": os.path.relpath(tmp, folder), **_described(tmp, described.get(name))}
                 for name, tmp in temps.items()}
        stale = sorted(set(_listed(folder)) - set(files)) if manifest else []
        for sub in {(folder / name).parent for name in files}:
            _sync_folder(sub)
        write_json(folder / JOURNAL, {"step": step, "manifest": manifest, "files": files,  # the commit point
                                      "remove": stale})
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
                raise CheckpointError(f"{folder}: the journal {JOURNAL} of an interrupted save lists {name}, but "
                                      f"neither it nor its temporary {entry['from']} is there; the checkpoint is "
                                      f"incomplete (restore it from a copy)")
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
        raise CheckpointError(f"{folder}: a save was committed (its journal {JOURNAL} is there) but could not be "
                              f"put in place: {detail}. Make the folder writable and load or save it again to "
                              f"complete it") from e


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


def check_manifest(folder: str | os.PathLike, names: Iterable[str] | None = None,
                   share: tuple[int, int] = (0, 1)) -> dict | None:
    """The folder's manifest, after checking the size and sha256 of each file it lists that matches
    one of the glob patterns `names` (all when None); None where there is no manifest. A file that is
    missing or differs raises CheckpointError naming it. `share` (rank, processes): the processes
    reading one checkpoint split the hashing, the i-th listed file hashed by process i mod processes
    only (every file's size is checked by all)."""
    rank, processes = share
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.exists():
        return None
    # a journal: a committed save not yet in place, which deleting the manifest would load mixed with the last
    finish = (f"a save that died after its commit point is unfinished ({JOURNAL} is there): read the folder with a "
              f"k3 command that can write it, to complete that save; do not delete {MANIFEST}"
              if (folder / JOURNAL).exists() else None)
    try:
        manifest = json.loads(path.read_text())
        listed = {name: (int(e["size"]), str(e["sha256"])) for name, e in manifest["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path}: not a readable k3 manifest ({type(e).__name__}: {e}); "
                              f"{finish or 'delete it to load the files unchecked'}") from e
    saved = f"the save at step {manifest['step']}" if manifest.get("step") is not None else "the save"
    advice = f"the checkpoint's files are not the ones {saved} wrote together" + (
        f": {finish}" if finish else f" (replaced, edited or damaged since). Restore the file, or delete "
                                     f"{MANIFEST} to load the files as they are")
    for i, (name, (size, sha256)) in enumerate(sorted(listed.items())):
        if names is not None and not any(fnmatch.fnmatchcase(name, pattern) for pattern in names):
            continue
        file = folder / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing: {advice}")
        actual_size = file.stat().st_size
        if actual_size != size:
            raise CheckpointError(f"{file} has {actual_size} bytes, its manifest says {size}: {advice}")
        if i % processes != rank:  # another process hashes it
            continue
        actual = describe(file)
        if actual["sha256"] != sha256:
            raise CheckpointError(f"{file} has sha256 {actual['sha256'][:16]}..., its manifest says "
                                  f"{sha256[:16]}...: {advice}")
    return manifest


@contextlib.contextmanager
def reading(folder: str | os.PathLike) -> Iterator[None]:
    """Every reader's way into a folder: locked, `recover`ed first; the block sees one whole save, never a mix."""
    with folder_lock(folder):
        recover(folder)
        yield


@contextlib.contextmanager
def checked_folder(folder: str | os.PathLike, names: Iterable[str] | None = None,
                   share: tuple[int, int] = (0, 1)) -> Iterator[dict | None]:
    """`reading`, with the files matching `names` checked (`check_manifest`); yields the manifest or None."""
    with reading(folder):
        yield check_manifest(folder, names, share)


@contextlib.contextmanager
def staging_folder(beside: str | os.PathLike) -> Iterator[Path]:
    """A new empty folder beside `beside` (its files can be renamed into place), removed when the block ends."""
    beside = Path(beside)
    beside.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=beside.parent, prefix=f".{beside.name}.", suffix=".tmp"))
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)
