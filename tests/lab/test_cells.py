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
    monkeypatch.setattr(
        recall,
        "score_mixer",
        lambda *job: (
            trained.append(job[1:])
            or recall._cell_from_json(json.loads((folder / "D=4,kda,1e-3.json").read_text())["result"])
        ),
    )
    lab.run("recall", "smoke", tmp_path)
    assert trained == [("kda", 4, 3e-3, 1)]
    assert (folder / "D=4,kda,3e-3.json").exists()


def test_a_kept_cell_has_int_pair_counts_again():
    out = recall._cell_from_json(
        {"accuracy": {"2": 0.5, "16": 0.1}, "retrieval": {"16": {"uniform": 0.1}}, "curve": [[1, 0.2]]}
    )
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


def _fake_cell(plan, mixer, head_dim, lr, train_from):
    """A cell as `score_mixer` returns it, with made-up numbers: attention solves every count, the others fall
    off past D, and the hybrids' attention heads read the bound value only in the probe that silences KDA."""
    pairs = plan.pairs(head_dim)
    solved = mixer in ("softmax", "2mla")
    accuracy = {p: 1.0 if solved else min(1.0, head_dim / p) * (0.9 if mixer == "linear_attn" else 1.0) for p in pairs}
    out = {
        "accuracy": accuracy,
        "curve": [[100, 0.2], [200, 0.5], [240, 0.55]],
        "stable": 200,
        "stopped_by": "plateau",
        "steps": 240,
    }
    if mixer != "softmax" and ("mla" in mixer or "mha" in mixer):
        best = 0.9 if mixer in ("2mla", "3kda0+mla", "mla+3kda") else 0.01
        out["retrieval"] = {p: {"value": [[best]], "key": [[0.0]], "uniform": 4 / (4 * p)} for p in pairs}
    if mixer in ("linear_attn", "deltanet") and train_from == 1:
        out["filler"] = {"pairs": head_dim, "long": 4 * plan.span * head_dim, "no filler": 0.9, "filler": 0.4}
    return out


def test_a_full_run_renders_from_its_kept_cells(tmp_path):
    """Every cell of the full plan kept (made up here): `k3 lab recall --full` trains nothing and writes the
    whole section: one table and sweep per state size, the ordering, the MLA attention, the probes, the
    filler, the disagreements, both figures."""
    plan = recall.PLANS["full"]
    main = max(plan.head_dims)
    cells = Cells(tmp_path / "lab" / "recall-full-cells", recall.cell_settings(plan))
    jobs = [(m, main, min(plan.lrs), max(1, times * main)) for m, times in recall.PROBES]
    jobs += [(m, d, lr, 1) for d in plan.head_dims for m in plan.mixers for lr in plan.lrs]
    for job in jobs:
        cells.put(recall._key((plan, *job)), _fake_cell(plan, *job))
    result = lab.run("recall", "full", tmp_path)
    captions = [t.caption for t in result.tables]
    assert sum(c.startswith("MQAR query accuracy") for c in captions) == 2
    assert any(c.startswith("The order of the mixers") for c in captions)
    assert any(c.startswith("The probes") for c in captions) and any("filler" in c for c in captions)
    verdicts = {c.claim: c.verdict for c in result.claims}
    assert (
        verdicts[
            "Linear attention adds every pair into one D×D state: past its capacity (N ≫ D) associations interfere"
        ]
        == "holds"
    )
    assert any(n.startswith("Disagreement — MLA in the hybrid") and "The cause is the start" in n for n in result.notes)
    assert (tmp_path / "figures" / "recall-curves-full.png").exists()
    assert json.loads((tmp_path / "lab" / "recall-full.json").read_text())["mode"] == "full"


def test_a_plan_without_probes_renders_without_their_table(tmp_path, monkeypatch):
    import dataclasses

    monkeypatch.setitem(
        recall.PLANS,
        "smoke",
        dataclasses.replace(
            recall.PLANS["smoke"], probes=False, mixers=("softmax", "linear_attn", "deltanet", "kda", "kda+mla")
        ),
    )
    result = lab.run("recall", "smoke", tmp_path)
    assert not any(t.caption.startswith("The probes") for t in result.tables)
    assert len(list((tmp_path / "lab" / "recall-cells").glob("*.json"))) == 5 * 2
    # the retrieval claim reads the 2-layer hybrid against KDA when the 4-layer pair is not in the plan
    assert any("KDA+MLA hybrid model" in c.measured for c in result.claims)
