"""`k3 export`'s output directory: an export never writes into its source nor over an existing
checkpoint. `k3 export run1 run1` used to overwrite the training checkpoint's config.json and
model.safetensors with the exported layout (then `k3 train --resume run1` died with KeyError 'train');
now OUT must be new or an empty directory outside the checkpoint, or the export is refused in one line
(exit 2 through the CLI) with nothing written."""

from __future__ import annotations

import json
import tempfile

import pytest

pytest.importorskip("transformers")

from k3.cli import main  # noqa: E402
from k3.hf import export as export_module  # noqa: E402
from k3.hf.export import export  # noqa: E402
from tests.hf.test_export import training_checkpoint  # noqa: E402


def snapshot(folder) -> dict[str, bytes]:
    """Every file under `folder` (hidden ones too), by relative path, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A k3 training checkpoint (config.json with "train", weights, tokenizer.json) in its own folder."""
    path = tmp_path_factory.mktemp("export_output") / "run1"
    path.mkdir()
    training_checkpoint(path, "kimi-linear-tiny", hidden_size=64, num_layers=2)
    return path


def test_exporting_into_the_checkpoint_itself_is_refused(run):
    before = snapshot(run)
    for out in (run, run / ".", run / "sub" / ".."):
        with pytest.raises(
            ValueError,
            match=r"`out` must be a new or empty directory outside the checkpoint, "
            r"got .*run1, which is the checkpoint being exported",
        ):
            export(run, out)
    with pytest.raises(ValueError, match="which is inside the checkpoint being exported"):
        export(run, run / "hf")
    with pytest.raises(ValueError, match="which holds the checkpoint being exported"):
        export(run, run.parent)
    assert snapshot(run) == before and not (run / "hf").exists()


def test_an_existing_output_is_refused_unless_empty(run, tmp_path):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "config.json").write_text('{"mine": true}')
    with pytest.raises(
        FileExistsError,
        match=r"`out` must be a new or empty directory, got .*taken, which holds "
        r"config.json; export to another directory, or empty it first",
    ):
        export(run, taken)
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="got .*file, which exists and is not a directory"):
        export(run, tmp_path / "file")
    assert (taken / "config.json").read_text() == '{"mine": true}' and (tmp_path / "file").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "taken"]  # no staging folder left

    empty, new = tmp_path / "empty", tmp_path / "new" / "hf"
    empty.mkdir()
    for out in (empty, new):
        names = export(run, out)
        assert "config.json" in names and sorted(p.name for p in out.iterdir()) == names
        assert json.loads((out / "config.json").read_text())["model_type"] == "k3"


def test_files_that_appear_while_exporting_are_not_overwritten(run, tmp_path, monkeypatch):
    out = tmp_path / "out"
    write_k3 = export_module._write_k3

    def meanwhile(model, directory, special):  # another program takes `out` while the files are written
        write_k3(model, directory, special)
        out.mkdir()
        (out / "config.json").write_text("theirs")

    monkeypatch.setattr(export_module, "_write_k3", meanwhile)
    with pytest.raises(FileExistsError, match="which holds config.json"):
        export(run, out)
    assert snapshot(out) == {"config.json": b"theirs"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_cli_refuses_to_export_a_checkpoint_onto_itself(run, tmp_path, capsys):
    before = snapshot(run)
    for out in (run, run / "hf"):
        assert main(["export", str(run), str(out)]) == 2
        err = capsys.readouterr().err
        assert (
            err.startswith("k3 export: error: export: `out` must be a new or empty directory outside the checkpoint")
            and err.count("\n") == 1
        ), err
    assert snapshot(run) == before  # config.json still holds "train": `k3 train --resume run1` works
    assert "train" in json.loads((run / "config.json").read_text())

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "model.safetensors").write_bytes(b"other")
    assert main(["export", str(run), str(taken)]) == 2
    err = capsys.readouterr().err
    assert "k3 export: error:" in err and "which holds model.safetensors" in err and err.count("\n") == 1
    assert snapshot(taken) == {"model.safetensors": b"other"}

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["export", str(run), str(empty), "--format", "kimi-linear"]) == 0
    assert json.loads((empty / "config.json").read_text())["model_type"] == "kimi_linear"
    assert snapshot(run) == before


def test_an_output_that_cannot_be_made_is_one_line_naming_it(run, tmp_path, capsys, monkeypatch):
    """A symbolic link loop, or a folder that cannot take new entries (/proc, or one without write
    permission), is answered in one line naming OUT, not the export's temporary name or a traceback."""
    loop = tmp_path / "loop"
    loop.symlink_to(tmp_path / "back")
    (tmp_path / "back").symlink_to(loop)
    for out in (loop, loop / "inside"):
        assert main(["export", str(run), str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"k3 export: error: export: `out` {out} cannot be resolved: a symbolic link loop")
        assert err.count("\n") == 1, err

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkdtemp", refused)
    out = tmp_path / "locked" / "out"
    (tmp_path / "locked").mkdir()
    assert main(["export", str(run), str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"k3 export: error: [Errno 13] cannot write {out} (in {out.parent}): Permission denied\n"
    assert not list((tmp_path / "locked").iterdir())
