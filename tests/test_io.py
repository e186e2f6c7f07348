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
from k3.io import (
    JOURNAL,
    MANIFEST,
    CheckpointError,
    atomic_write,
    atomic_write_files,
    check_manifest,
    checked_folder,
    move_files_into,
    staging_folder,
)


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
    atomic_write_files(
        tmp_path / "ckpt", {"a": lambda t: Path(t).write_text("a1"), "b": lambda t: Path(t).write_text("b1")}
    )

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
    atomic_write_files(
        folder,
        {"a": lambda t: Path(t).write_text("a1"), "b": lambda t: Path(t).write_text("b1")},
        step=1,
        manifest=True,
    )

    def died(folder):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(k3.io.journal, "_roll_forward", died)
        with pytest.raises(KeyboardInterrupt):
            atomic_write_files(
                folder,
                {"a": lambda t: Path(t).write_text("a22"), "b": lambda t: Path(t).write_text("b2")},
                step=2,
                manifest=True,
            )
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

    monkeypatch.setattr(k3.io.journal.os, "replace", read_only)
    with pytest.raises(
        CheckpointError,
        match=rf"{folder}: a save was committed \(its journal .k3-commit.json is there\) "
        r"but could not be put in place: Read-only file system. Make the folder "
        r"writable",
    ):
        with checked_folder(folder):
            pass


def test_a_check_of_an_unfinished_save_never_advises_deleting_the_manifest(tmp_path, monkeypatch):
    """The journal of a save that died after its commit point is there: the files are between two saves, and
    deleting the manifest would load that mix. `reading` (what every reader calls) finishes the save first."""
    folder = tmp_path / "ckpt"
    _interrupted_after_the_commit(folder, monkeypatch)
    (folder / "a").write_text("a33")  # a file that neither save wrote, so the check fails before any recovery
    with pytest.raises(CheckpointError) as refused:
        k3.io.check_manifest(folder)
    assert "do not delete .k3-manifest.json" in str(refused.value) and "to load the files as they are" not in str(
        refused.value
    )
    (folder / "a").write_text("a1")
    with k3.io.reading(folder):
        assert not (folder / JOURNAL).exists() and (folder / "a").read_text() == "a22"
        assert k3.io.check_manifest(folder)["step"] == 2


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
    atomic_write_files(
        folder,
        {"a": lambda t: Path(t).write_text("a1"), "b": lambda t: Path(t).write_text("b1")},
        step=7,
        manifest=True,
    )
    (folder / "b").write_text("b2")
    with pytest.raises(
        CheckpointError,
        match=rf"{folder / 'b'} has sha256 .*, its manifest says .*: the checkpoint's "
        r"files are not the ones the save at step 7 wrote together",
    ):
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
    atomic_write_files(
        folder,
        {"a": lambda t: Path(t).write_text("a1"), "b": lambda t: Path(t).write_text("b1")},
        step=3,
        manifest=True,
    )
    atomic_write_files(folder, {"b": lambda t: Path(t).write_text("b22")})  # save_pretrained over a checkpoint
    assert check_manifest(folder)["files"]["b"]["size"] == 3


def test_a_set_of_files_gets_the_permissions_open_gives(tmp_path):
    from safetensors.torch import save_file

    previous = os.umask(0o027)
    try:
        atomic_write_files(
            tmp_path / "ckpt",
            {
                "w.safetensors": lambda t: save_file({"x": torch.zeros(2)}, t),
                "c.json": lambda t: Path(t).write_text("{}"),
            },
            manifest=True,
        )
    finally:
        os.umask(previous)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "ckpt").iterdir()}
    assert modes == {"w.safetensors": "0o640", "c.json": "0o640", MANIFEST: "0o640"}


def _text(content: str):
    return lambda tmp: Path(tmp).write_text(content)


def _tree(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): p.read_text()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name not in (MANIFEST,)
    }


def test_a_training_set_drops_the_files_of_its_previous_set_that_it_lacks(tmp_path):
    """A sharded checkpoint replacing a whole one (and back): the previous set's files that the new set
    lacks go at the commit, with the subfolder they leave empty; a file no manifest listed stays."""
    folder = tmp_path / "ckpt"
    atomic_write_files(
        folder,
        {"config.json": _text("1"), "dcp/__0_0.distcp": _text("r0"), "dcp/__1_0.distcp": _text("r1")},
        step=1,
        manifest=True,
    )
    (folder / "notes.txt").write_text("mine")
    assert check_manifest(folder)["files"].keys() == {"config.json", "dcp/__0_0.distcp", "dcp/__1_0.distcp"}
    atomic_write_files(folder, {"config.json": _text("2"), "dcp/__0_0.distcp": _text("R0")}, step=2, manifest=True)
    assert _tree(folder) == {"config.json": "2", "dcp/__0_0.distcp": "R0", "notes.txt": "mine"}
    atomic_write_files(folder, {"config.json": _text("3"), "model.safetensors": _text("w")}, step=3, manifest=True)
    assert _tree(folder) == {"config.json": "3", "model.safetensors": "w", "notes.txt": "mine"}
    assert not (folder / "dcp").exists() and check_manifest(folder)["step"] == 3
    # a set for other programs (no manifest of its own) removes nothing
    atomic_write_files(folder, {"extra.json": _text("{}")})
    assert set(_tree(folder)) == {"config.json", "model.safetensors", "notes.txt", "extra.json"}


def test_files_of_several_processes_are_committed_from_a_shared_staging_folder(tmp_path):
    from k3.io import commit_files, describe, shared_staging

    folder = tmp_path / "ckpt"
    atomic_write_files(folder, {"config.json": _text("old")}, step=1, manifest=True)
    with shared_staging(folder) as staging:
        assert staging.parent == folder and staging.name.startswith(".staging.k3-")
        for rank in range(2):  # each "process" writes and hashes its own file
            (staging / f"__{rank}_0.distcp").write_text(f"shard {rank}")
        described = {f"dcp/{p.name}": describe(p) for p in staging.iterdir()}
        lying = {**described, "dcp/__1_0.distcp": {"size": 3, "sha256": "0" * 64}}
        with pytest.raises(CheckpointError, match=r"__1_0.distcp.*: 7 bytes, but the process that wrote it counted 3"):
            commit_files(folder, {name: _mover(staging, name) for name in described}, 2, True, lying)
        assert _tree(folder) == {"config.json": "old"}  # (the moved files' temporaries are gone)
        assert sorted(p.name for p in staging.iterdir()) == []  # moved out, then removed
        for rank in range(2):
            (staging / f"__{rank}_0.distcp").write_text(f"shard {rank}")
        writers = {name: _mover(staging, name) for name in described} | {"config.json": _text("new")}
        commit_files(folder, writers, 2, True, described)
    assert not staging.exists()
    assert _tree(folder) == {"config.json": "new", "dcp/__0_0.distcp": "shard 0", "dcp/__1_0.distcp": "shard 1"}
    assert check_manifest(folder)["files"]["dcp/__1_0.distcp"] == described["dcp/__1_0.distcp"]
    with pytest.raises(RuntimeError, match="must hold the lock"):
        commit_files(folder, {"x": _text("x")})


def _mover(staging: Path, name: str):
    return lambda tmp: os.replace(staging / Path(name).name, tmp)


def test_an_abandoned_staging_folder_and_temporaries_in_a_subfolder_are_cleared(tmp_path):
    """A process killed in the middle of a sharded save leaves its staging folder and, in dcp/, the
    temporaries of an uncommitted save: the next reader removes both, and only them."""
    folder = tmp_path / "ckpt"
    atomic_write_files(folder, {"dcp/.metadata": _text("m"), "config.json": _text("c")}, step=1, manifest=True)
    (folder / ".staging.k3-abc123.tmp").mkdir()
    (folder / ".staging.k3-abc123.tmp" / "__0_0.distcp").write_text("half")
    (folder / "dcp" / ".__0_0.distcp.k3-xyz789.tmp").write_text("half")
    (folder / "dcp" / "keep.txt").write_text("user's")
    with checked_folder(folder) as manifest:
        assert manifest["step"] == 1
    assert _tree(folder) == {"config.json": "c", "dcp/.metadata": "m", "dcp/keep.txt": "user's"}
