"""Writing files so that a reader never sees a half-written one.

Every file k3 writes (checkpoints, exports, the lab's results and figures, the unpacked corpus) goes
through this module: the content is written under a temporary name in the target's own folder (the
same filesystem, so the final `os.replace` is an atomic rename), and the temporary is removed if
writing fails or is interrupted.

- `atomic_write(path, write)`: one file.
- `atomic_write_files(folder, writers)`: several files; all are written before any is renamed into
  place, so a failure while writing leaves every old file as it was.
- `write_json(path, obj)`: a JSON file (the benchmarks' figures).
- `staging_folder(beside)`: a fresh temporary folder beside a target, for writers that produce a
  whole folder (transformers' `save_pretrained`, an unpacked archive); removed on exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

Writer = Callable[[str], object]  # writes the file at the path it is given


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def temp_beside(path: str | os.PathLike) -> str:
    """A new empty temporary file in path's folder, with the permissions a plain open() would give
    (mkstemp makes it owner-only)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_umask())
    return tmp


def _remove(paths) -> None:
    for tmp in paths:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write(path: str | os.PathLike, write: Writer) -> None:
    """Call write(tmp_path) on a temporary file beside `path`, then rename it over `path`: readers see
    the old file or the new one, never a partial one."""
    tmp = temp_beside(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        _remove([tmp])
        raise


def write_json(path: str | os.PathLike, obj, indent: int = 1) -> None:
    """`obj` as JSON at `path`, atomically."""
    text = json.dumps(obj, indent=indent)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def atomic_write_files(folder: str | os.PathLike, writers: dict[str, Writer]) -> None:
    """Write every file `name` of `writers` in `folder` (created if needed) with writer(tmp_path); only
    once all are complete are they renamed into place, in the order given. A failure while writing
    removes the temporaries and leaves the folder's files as they were."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    temps: dict[str, str] = {}
    try:
        for name, write in writers.items():
            temps[name] = tmp = temp_beside(folder / name)
            write(tmp)
    except BaseException:
        _remove(temps.values())
        raise
    for name, tmp in temps.items():
        os.replace(tmp, folder / name)


@contextlib.contextmanager
def staging_folder(beside: str | os.PathLike) -> Iterator[Path]:
    """A new empty folder next to `beside` (same filesystem: its contents can be renamed into place),
    removed with whatever is left in it when the block ends."""
    beside = Path(beside)
    beside.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=beside.parent, prefix=f".{beside.name}.", suffix=".tmp"))
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def move_files_into(staging: str | os.PathLike, folder: str | os.PathLike) -> list[str]:
    """Rename every file of `staging` into `folder` (created if needed), with the permissions a plain
    open() would give; returns their names, sorted."""
    staging, folder = Path(staging), Path(folder)
    names = sorted(p.name for p in staging.iterdir())
    folder.mkdir(parents=True, exist_ok=True)
    mode = 0o666 & ~_umask()
    for name in names:
        os.chmod(staging / name, mode)  # some writers (safetensors) make owner-only files
        os.replace(staging / name, folder / name)
    return names
