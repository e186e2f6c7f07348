"""Finished cells of a long sweep, kept as they finish so that a stopped run resumes where it stopped.

A `k3 lab recall --full` run trains dozens of models for hours on a 2-core CPU. Each finished model's result
(a "cell": one mixer, state size and learning rate) is written at once to its own JSON file, with a
fingerprint of the plan it ran under. Run again with the same plan, the experiment reads the cells it finds
and trains only the missing ones; a cell from another plan is trained again. Committing the folder (the
repository's `docs/lab/recall-full-cells/`) carries a run across machines and sessions. Delete the folder
to start afresh, e.g. after changing the models' code, which the fingerprint does not see.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..io import read_json, write_json


class Cells:
    """The cells of one sweep under `folder`, for the plan `plan` (any JSON-able description of it)."""

    def __init__(self, folder: str | Path, plan):
        self.folder = Path(folder)
        text = json.dumps(plan, sort_keys=True, default=str)
        self.fingerprint = hashlib.sha256(text.encode()).hexdigest()[:16]

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.json"

    def get(self, key: str):
        """The result kept for `key` under this plan, or None (no file, or one from another plan)."""
        path = self.path(key)
        if not path.exists():
            return None
        kept = read_json(path)
        return kept["result"] if kept.get("plan") == self.fingerprint else None

    def put(self, key: str, result) -> None:
        """Keep `result` for `key` (atomically: an interrupted write leaves the old file or none)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        write_json(self.path(key), {"plan": self.fingerprint, "result": result})
