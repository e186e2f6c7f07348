"""`k3 lab --docs`: a path that is a file (or holds a file where lab/ or figures/ go) is one line naming
it, before any experiment runs."""

from __future__ import annotations

from k3 import lab
from tests.commands import fails


def test_a_docs_path_that_is_a_file_is_refused_before_any_experiment(tmp_path, capsys, monkeypatch):
    ran = []
    monkeypatch.setattr(lab, "run", lambda *a, **k: ran.append(a))
    file = tmp_path / "results.md"
    file.write_text("mine")
    fails(
        capsys, ["lab", "recall", "--smoke", "--docs", str(file)], f"--docs {file}: {file} exists and is not a folder"
    )
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "figures").write_text("mine")
    fails(capsys, ["lab", "all", "--docs", str(folder)], f"{folder / 'figures'} exists and is not a folder")
    assert not ran and file.read_text() == "mine"
