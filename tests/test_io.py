"""k3.io: a failed or interrupted write leaves the old files and no temporaries; a set of files is
replaced whole (journal, manifest, recovery by the next reader)."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

import pytest
import torch

import k3.io
from k3.io import (JOURNAL, MANIFEST, CheckpointError, atomic_write, atomic_write_files, check_manifest, checked_folder,
                   move_files_into, staging_folder)


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
    assert sorted(p.name for p in folder.iterdir()) == ["a", "b"]
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


def _interrupted_after_the_commit(folder: Path, monkeypatch) -> None:
    """Leave `folder` as a save that died just after writing its journal: "a" and "b" at version 1 in
    place, version 2 in temporaries named by the journal."""
    atomic_write_files(folder, {"a": lambda t: Path(t).write_text("a1"), "b": lambda t: Path(t).write_text("b1")}, step=1,
                       manifest=True)

    def died(folder):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(k3.io, "_roll_forward", died)
        with pytest.raises(KeyboardInterrupt):
            atomic_write_files(folder, {"a": lambda t: Path(t).write_text("a22"), "b": lambda t: Path(t).write_text("b2")},
                               step=2, manifest=True)
    assert (folder / JOURNAL).exists() and (folder / "a").read_text() == "a1"


def test_a_committed_save_is_finished_by_the_next_reader(tmp_path, monkeypatch):
    folder = tmp_path / "ckpt"
    _interrupted_after_the_commit(folder, monkeypatch)
    with checked_folder(folder) as manifest:
        assert (folder / "a").read_text() == "a22" and (folder / "b").read_text() == "b2"
    assert manifest["step"] == 2 and manifest["files"]["a"] == {"size": 3, "sha256": hashlib.sha256(b"a22").hexdigest()}
    assert sorted(p.name for p in folder.iterdir()) == [MANIFEST, "a", "b"]


def test_a_committed_save_in_a_read_only_folder_is_a_clear_error(tmp_path, monkeypatch):
    folder = tmp_path / "ckpt"
    _interrupted_after_the_commit(folder, monkeypatch)

    def read_only(*args):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(k3.io.os, "replace", read_only)
    with pytest.raises(CheckpointError, match=rf"{folder}: a save was committed \(its journal .k3-commit.json is there\) "
                                              r"but could not be put in place: Read-only file system. Make the folder "
                                              r"writable"):
        with checked_folder(folder):
            pass


def test_an_uncommitted_saves_temporaries_are_removed_by_the_next_reader_or_writer(tmp_path):
    folder = tmp_path / "ckpt"
    atomic_write_files(folder, {"a": lambda t: Path(t).write_text("a1")}, manifest=True)
    (folder / ".a.k3-x1y2z3w4.tmp").write_text("half of a2")  # left by a save killed before its commit
    (folder / ".model.safetensors.x1y2z3w4.tmp").write_text("?")  # by one of an earlier k3
    (folder / ".notes.tmp").write_text("the user's")
    with checked_folder(folder):
        pass
    assert sorted(p.name for p in folder.iterdir()) == [MANIFEST, ".notes.tmp", "a"]
    (folder / ".b.k3-x1y2z3w4.tmp").write_text("?")
    atomic_write_files(folder, {"a": lambda t: Path(t).write_text("a2")})
    assert sorted(p.name for p in folder.iterdir()) == [MANIFEST, ".notes.tmp", "a"]


def test_a_file_that_differs_from_the_manifest_is_refused_by_name(tmp_path):
    folder = tmp_path / "ckpt"
    atomic_write_files(folder, {"a": lambda t: Path(t).write_text("a1"), "b": lambda t: Path(t).write_text("b1")}, step=7,
                       manifest=True)
    (folder / "b").write_text("b2")
    with pytest.raises(CheckpointError, match=rf"{folder / 'b'} has sha256 .*, its manifest says .*: the checkpoint's "
                                              r"files are not the ones the save at step 7 wrote together"):
        check_manifest(folder)
    assert check_manifest(folder, ["a"])["step"] == 7  # only the files asked for are checked
    (folder / "b").write_text("b22")
    with pytest.raises(CheckpointError, match="b has 3 bytes, its manifest says 2"):
        check_manifest(folder)
    (folder / "b").unlink()
    with pytest.raises(CheckpointError, match="b is missing"):
        check_manifest(folder)
    (folder / MANIFEST).unlink()  # a folder from before manifests: read as it is
    assert check_manifest(folder) is None


def test_a_manifest_is_kept_true_by_a_save_that_does_not_start_one(tmp_path):
    folder = tmp_path / "ckpt"
    atomic_write_files(folder, {"a": lambda t: Path(t).write_text("a1")})
    assert not (folder / MANIFEST).exists()
    atomic_write_files(folder, {"a": lambda t: Path(t).write_text("a1"), "b": lambda t: Path(t).write_text("b1")},
                       step=3, manifest=True)
    atomic_write_files(folder, {"b": lambda t: Path(t).write_text("b22")})  # save_pretrained over a checkpoint
    assert check_manifest(folder)["files"]["b"]["size"] == 3


def test_a_set_of_files_gets_the_permissions_open_gives(tmp_path):
    from safetensors.torch import save_file

    previous = os.umask(0o027)
    try:
        atomic_write_files(tmp_path / "ckpt", {"w.safetensors": lambda t: save_file({"x": torch.zeros(2)}, t),
                                               "c.json": lambda t: Path(t).write_text("{}")}, manifest=True)
    finally:
        os.umask(previous)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "ckpt").iterdir()}
    assert modes == {"w.safetensors": "0o640", "c.json": "0o640", MANIFEST: "0o640"}
