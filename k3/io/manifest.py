"""Reading a folder of files saved together: `reading` (locked, recovered first) and the check of its
manifest (`check_manifest`, `checked_folder`), which refuses a file that differs from what the save wrote."""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
from pathlib import Path
from typing import Iterable, Iterator

from .atomic import CheckpointError, describe, folder_lock
from .journal import JOURNAL, MANIFEST, recover


def check_manifest(
    folder: str | os.PathLike, names: Iterable[str] | None = None, share: tuple[int, int] = (0, 1)
) -> dict | None:
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
    finish = (
        f"a save that died after its commit point is unfinished ({JOURNAL} is there): read the folder with a "
        f"k3 command that can write it, to complete that save; do not delete {MANIFEST}"
        if (folder / JOURNAL).exists()
        else None
    )
    try:
        manifest = json.loads(path.read_text())
        listed = {name: (int(e["size"]), str(e["sha256"])) for name, e in manifest["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(
            f"{path}: not a readable k3 manifest ({type(e).__name__}: {e}); "
            f"{finish or 'delete it to load the files unchecked'}"
        ) from e
    saved = f"the save at step {manifest['step']}" if manifest.get("step") is not None else "the save"
    advice = f"the checkpoint's files are not the ones {saved} wrote together" + (
        f": {finish}"
        if finish
        else f" (replaced, edited or damaged since). Restore the file, or delete "
        f"{MANIFEST} to load the files as they are"
    )
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
            raise CheckpointError(
                f"{file} has sha256 {actual['sha256'][:16]}..., its manifest says {sha256[:16]}...: {advice}"
            )
    return manifest


@contextlib.contextmanager
def reading(folder: str | os.PathLike) -> Iterator[None]:
    """Every reader's way into a folder: locked, `recover`ed first; the block sees one whole save, never a mix."""
    with folder_lock(folder):
        recover(folder)
        yield


@contextlib.contextmanager
def checked_folder(
    folder: str | os.PathLike, names: Iterable[str] | None = None, share: tuple[int, int] = (0, 1)
) -> Iterator[dict | None]:
    """`reading`, with the files matching `names` checked (`check_manifest`); yields the manifest or None."""
    with reading(folder):
        yield check_manifest(folder, names, share)
