"""k3 lab's report: results render to markdown, round-trip through JSON, and results.md keeps the registry order."""

import json

import pytest

from k3.lab import EXPERIMENTS
from k3.lab.report import Claim, Figure, Result, Table, command, load_results, save_result, write_results


def result(name: str, verdict: str = "holds") -> Result:
    return Result(
        name=name,
        title=f"Title of {name}",
        mode="quick",
        command=command(name, "quick"),
        claims=[Claim("the article says X", "we measured 0.5", verdict)],
        tables=[Table("caption", ["a", "b"], [[1, 2.5], ["x", 12345.6]])],
        figures=[Figure(f"figures/{name}.png", "a picture")],
        notes=["a note"],
        setup={"steps": 3},
        data={"raw": [1, 2]},
    )


def test_round_trip_and_markdown(tmp_path):
    r = result("recall")
    save_result(r, tmp_path)
    (back,) = load_results(tmp_path, ["recall"])
    assert back == r
    md = back.markdown()
    assert "| the article says X | we measured 0.5 | **holds** |" in md
    assert "| 1 | 2.5 |" in md and "| x | 12,346 |" in md
    assert "![a picture](figures/recall.png)" in md and "`k3 lab recall --quick`" in md
    assert json.loads((tmp_path / "lab" / "recall.json").read_text())["data"] == {"raw": [1, 2]}


def test_results_md_in_registry_order(tmp_path):
    names = list(EXPERIMENTS)
    for name in reversed(names[:3]):
        save_result(result(name, "partly"), tmp_path)
    text = write_results(tmp_path, names).read_text()
    positions = [text.index(f"## Title of {n}") for n in names[:3]]
    assert positions == sorted(positions)
    assert "| 0 of 1 |" in text


def test_bad_verdict_and_ragged_table_are_refused():
    with pytest.raises(ValueError, match="verdict"):
        Claim("c", "m", "maybe")
    with pytest.raises(ValueError, match="row 0 has 1 cells"):
        Table("t", ["a", "b"], [[1]])


def test_unknown_experiment_and_mode(tmp_path):
    from k3 import lab

    with pytest.raises(ValueError, match="unknown experiment 'nope'"):
        lab.run("nope", "quick", tmp_path)
    with pytest.raises(ValueError, match="mode must be one of"):
        lab.run("recall", "fast", tmp_path)
    assert command("recall", "full") == "k3 lab recall --full"


def test_lab_writes_under_runs_unless_told_docs():
    """`k3 lab NAME` never overwrites the repository's docs/ unless asked with --docs."""
    from k3.cli import build_parser

    assert build_parser().parse_args(["lab", "recall"]).docs == "runs/lab"
    assert build_parser().parse_args(["lab", "all", "--docs", "docs"]).docs == "docs"


def test_results_md_names_the_commit_that_ran(tmp_path):
    for name, commit in (("recall", "abc1234"), ("overwrite", "abc1234")):
        r = result(name)
        r.machine = {"commit": commit}
        save_result(r, tmp_path)
    text = write_results(tmp_path, list(EXPERIMENTS)).read_text()
    assert "Generated from k3 commit abc1234." in text
