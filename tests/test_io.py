"""k3.io: a failed or interrupted write leaves the old files and no temporaries."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from k3.io import atomic_write, atomic_write_files, move_files_into, staging_folder


def test_atomic_write_replaces_whole_or_not_at_all(tmp_path):
    path = tmp_path / "a.txt"
    atomic_write(path, lambda tmp: Path(tmp).write_text("one"))
    assert path.read_text() == "one"

    def fails(tmp):
        Path(tmp).write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, fails)
    assert path.read_text() == "one" and [p.name for p in tmp_path.iterdir()] == ["a.txt"]
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def test_atomic_write_files_renames_only_when_all_are_written(tmp_path):
    atomic_write_files(tmp_path / "ckpt", {"a": lambda t: Path(t).write_text("a1"), "b": lambda t: Path(t).write_text("b1")})

    def fails(tmp):
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        atomic_write_files(tmp_path / "ckpt", {"a": lambda t: Path(t).write_text("a2"), "b": fails})
    folder = tmp_path / "ckpt"
    assert sorted(p.name for p in folder.iterdir()) == [".k3-manifest.json", "a", "b"]
    assert (folder / "a").read_text() == "a1" and (folder / "b").read_text() == "b1"


def test_staging_folder_is_removed_and_its_files_move_into_place(tmp_path):
    out = tmp_path / "export"
    with staging_folder(out) as staging:
        assert staging.parent == tmp_path and staging.is_dir()
        (staging / "x.json").write_text("{}")
        os.chmod(staging / "x.json", 0o600)
        assert move_files_into(staging, out) == ["x.json"]
    assert not staging.exists() and (out / "x.json").read_text() == "{}"
    assert oct((out / "x.json").stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    with pytest.raises(RuntimeError):
        with staging_folder(out) as staging:
            (staging / "partial").write_text("?")
            raise RuntimeError
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask
