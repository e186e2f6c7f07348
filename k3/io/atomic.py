"""One file written atomically (`atomic_write`, `write_json`), the folder lock every writer and reader
takes (`folder_lock`), a staging folder beside a target (`staging_folder`), and the helpers the sets of
files (`k3.io.journal`) share: temporaries beside their target, flushes, a file's size and sha256."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Iterator

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; the journal still makes a save all-or-nothing
    fcntl = None

Writer = Callable[[str], object]  # writes the file at the path it is given


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
    """The JSON value in the file `path` (UTF-8, a leading BOM skipped); one that is not UTF-8 JSON: a ValueError
    naming it and where it breaks."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8-sig"))  # a BOM (Windows editors write one) is no text
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); fix the file or "
            f"restore it from a copy"
        ) from None
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}), so not a "
            f"JSON file; restore it from a copy"
        ) from None


def describe(path: str | os.PathLike) -> dict:
    """{"size": bytes, "sha256": hex digest} of a file."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            sha.update(block)
    return {"size": os.path.getsize(path), "sha256": sha.hexdigest()}


@contextlib.contextmanager
def staging_folder(beside: str | os.PathLike) -> Iterator[Path]:
    """A new empty folder beside `beside` (its files can be renamed into place), removed when the block ends."""
    beside = Path(beside)
    try:
        beside.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=beside.parent, prefix=f".{beside.name}.", suffix=".tmp"))
    except OSError as e:  # named by what was asked for, not by the temporary name
        raise OSError(e.errno, f"cannot write {beside} (in {beside.parent}): {e.strerror}") from e
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)
