"""A long sweep keeps each finished cell at once and resumes with the cells it lacks (`k3.lab.cells`)."""

import json

import pytest

from k3 import lab
from k3.lab import recall
from k3.lab.cells import Cells


def test_cells_are_kept_per_plan(tmp_path):
    cells = Cells(tmp_path / "cells", {"steps": 10})
    assert cells.get("a") is None
    cells.put("a", {"accuracy": {"2": 0.5}})
    assert cells.get("a") == {"accuracy": {"2": 0.5}}
    assert Cells(tmp_path / "cells", {"steps": 10}).get("a") == {"accuracy": {"2": 0.5}}
    assert Cells(tmp_path / "cells", {"steps": 11}).get("a") is None  # another plan trains it again
    assert [p.name for p in (tmp_path / "cells").iterdir()] == ["a.json"]  # nothing else left beside it


def test_recall_resumes_from_its_kept_cells(tmp_path, monkeypatch):
    first = lab.run("recall", "smoke", tmp_path)
    folder = tmp_path / "lab" / "recall-cells"
    plan = recall.PLANS["smoke"]
    assert len(list(folder.glob("*.json"))) == len(plan.mixers) * len(plan.lrs) + len(recall.PROBES)
    assert (folder / "D=4,3kda+mla,1e-3,from8.json").exists()  # a probe trained from 2 x D pairs up

    # a second run with every cell kept trains nothing and renders the same tables
    def no_training(*args):
        raise AssertionError("a kept cell was trained again")

    monkeypatch.setattr(recall, "score_mixer", no_training)
    again = lab.run("recall", "smoke", tmp_path)
    assert [t.rows for t in again.tables] == [t.rows for t in first.tables]

    # one cell lost: only that one is trained
    (folder / "D=4,kda,3e-3.json").unlink()
    trained = []
    monkeypatch.setattr(recall, "score_mixer", lambda *job: trained.append(job[1:]) or
                        recall._cell_from_json(json.loads((folder / "D=4,kda,1e-3.json").read_text())["result"]))
    lab.run("recall", "smoke", tmp_path)
    assert trained == [("kda", 4, 3e-3, 1)]
    assert (folder / "D=4,kda,3e-3.json").exists()


def test_a_kept_cell_has_int_pair_counts_again():
    out = recall._cell_from_json({"accuracy": {"2": 0.5, "16": 0.1}, "retrieval": {"16": {"uniform": 0.1}},
                                  "curve": [[1, 0.2]]})
    assert out["accuracy"] == {2: 0.5, 16: 0.1} and list(out["retrieval"]) == [16]
    with pytest.raises(KeyError):
        _ = out["filler"]


def test_plans_that_differ_only_in_which_cells_they_have_share_them():
    import dataclasses

    full = recall.PLANS["full"]
    fewer = dataclasses.replace(full, lrs=full.lrs[:1], mixers=full.mixers[:3], probes=False)
    assert recall.cell_settings(fewer) == recall.cell_settings(full)
    # a smaller state changes the vocabulary (4x the most pairs), so its cells are its own
    assert recall.cell_settings(dataclasses.replace(full, head_dims=(4,))) != recall.cell_settings(full)
    assert recall.cell_settings(dataclasses.replace(full, batch=64)) != recall.cell_settings(full)
