"""No k3 command replaces a file of the user's (issue 46, point 1): `k3 bench ... --json PATH` replaces only
figures k3 bench wrote, `k3 lab --docs DIR` writes only in a folder that is new or the lab's. Both refuse before
anything runs, in one line. (`k3 train --out` and `k3 export`: tests/training/test_train_out.py and
tests/hf/test_export_output.py.)"""

from __future__ import annotations

import json

import pytest

from k3.bench.timing import check_report_target, write_report
from k3.cli import main
from k3.lab.report import LAB_MARK, claim_folder


def test_bench_json_never_replaces_a_file_it_did_not_write(tmp_path, capsys):
    mine = tmp_path / "notes.json"
    mine.write_text('{"my": "numbers"}')
    assert main(["bench", "ops", "--quick", "--json", str(mine)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"k3 bench: error: --json {mine}: the file exists and k3 bench did not write it; give another "
        f"path, or move the file away"
    ]
    assert mine.read_text() == '{"my": "numbers"}'
    with pytest.raises(FileExistsError):
        write_report(mine, {"x": 1}, "ops")  # the library's own writer refuses too
    assert mine.read_text() == '{"my": "numbers"}'


def test_bench_json_replaces_its_own_figures(tmp_path):
    path = tmp_path / "ops.json"
    write_report(path, {"x": 1}, "ops")
    assert json.loads(path.read_text()) == {"written_by": "k3 bench ops", "x": 1}
    check_report_target(path)
    write_report(path, {"x": 2}, "ops")
    assert json.loads(path.read_text())["x"] == 2
    with pytest.raises(IsADirectoryError, match="a folder"):
        check_report_target(tmp_path)


@pytest.mark.parametrize("bench", [["ops", "--quick"], ["parallel", "--layouts", "2:1"]])
def test_bench_json_in_a_folder_that_takes_no_file_is_refused_before_any_work(tmp_path, capsys, bench):
    missing = tmp_path / "no such folder" / "figures.json"
    assert main(["bench", *bench, "--json", str(missing)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"k3 bench: error: --json {missing}: {missing.parent} is no folder; give a path in an existing folder"
    ]
    assert main(["bench", *bench, "--json", "/proc/figures.json"]) == 2
    assert capsys.readouterr().err.startswith(
        "k3 bench: error: --json /proc/figures.json: cannot write a file in /proc"
    )


def test_bench_parallel_names_an_unknown_preset_before_any_process(capsys):
    assert main(["bench", "parallel", "--preset", "nope"]) == 2
    assert capsys.readouterr().err.startswith("k3 bench: error: --preset 'nope' is no preset; the presets are: gpt2")


def test_lab_refuses_a_folder_of_the_users_files(tmp_path, capsys):
    docs = tmp_path / "mine"
    (docs / "figures").mkdir(parents=True)
    (docs / "results.md").write_text("# my results\n")
    (docs / "figures" / "x.png").write_bytes(b"png")
    assert main(["lab", "parts", "--smoke", "--docs", str(docs)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"k3 lab: error: --docs {docs}: it holds results.md, figures, which k3 lab did not write")
    assert (docs / "results.md").read_text() == "# my results\n" and not (docs / LAB_MARK).exists()
    assert sorted(p.name for p in docs.rglob("*")) == ["figures", "results.md", "x.png"]


def test_lab_claims_a_new_folder_and_keeps_writing_in_it(tmp_path):
    docs = tmp_path / "lab"
    claim_folder(docs)
    assert (docs / LAB_MARK).exists()
    (docs / "lab").mkdir()  # an interrupted first run: cells, no results.md yet
    claim_folder(docs)


def test_lab_takes_a_folder_whose_page_it_wrote(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "results.md").write_text("# k3 lab: the article's claims, measured\n")
    (docs / "figures").mkdir()
    claim_folder(docs)  # the repository's docs/ is such a folder
    other = tmp_path / "other"
    other.mkdir()
    (other / "unrelated.txt").write_text("x")
    claim_folder(other)  # files the lab never writes are no obstacle
    assert (other / "unrelated.txt").read_text() == "x"


def test_lab_takes_a_folder_of_its_own_cells_and_results(tmp_path):
    from k3.lab.cells import Cells

    docs = tmp_path / "run"
    Cells(docs / "lab" / "recall-cells", {"plan": 1}).put("cell", {"accuracy": 1.0})  # an earlier run's, unmarked
    claim_folder(docs)
    (docs / LAB_MARK).unlink()
    (docs / "lab" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="it holds lab, which k3 lab did not write"):
        claim_folder(docs)
