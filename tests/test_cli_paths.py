"""The command line's paths (issue 60): every flag or argument that names a file or folder answers a
path it cannot use — missing, a file where a folder goes and the reverse, a symbolic link loop, a place
under a file, a folder nothing can be created in (/proc), an empty string — in one line naming it, with
exit 2 and nothing written; never a traceback, never an error naming a temporary file."""

from __future__ import annotations

import pytest
import torch

from k3 import lab
from k3.cli import main
from k3.models import CausalLM, get_config
from k3.tokenizer import byte_tokenizer

KINDS = ["missing", "file", "empty folder", "loop", "under a file", "proc", "empty string"]


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    root = tmp_path_factory.mktemp("paths")
    (root / "file").write_text("not a checkpoint\n")
    (root / "empty").mkdir()
    (root / "loop").symlink_to(root / "loop2")
    (root / "loop2").symlink_to(root / "loop")
    checkpoint = root / "checkpoint"
    torch.manual_seed(0)
    CausalLM(get_config("kimi-k3-tiny", vocab_size=257, hidden_size=32)).save_pretrained(checkpoint)
    byte_tokenizer().save(checkpoint / "tokenizer.json")
    paths = {
        "missing": root / "missing" / "deeper",
        "file": root / "file",
        "empty folder": root / "empty",
        "loop": root / "loop",
        "under a file": root / "file" / "inside",
        "proc": "/proc/k3-no-such-entry/x",
        "empty string": "",
    }
    return root, checkpoint, {k: str(v) for k, v in paths.items()}


# (the command with P where the path goes, the kinds it cannot use)
COMMANDS = {
    "generate --checkpoint": (["generate", "--checkpoint", "P", "--prompt", "to be"], KINDS),
    "export CHECKPOINT": (["export", "P", "OUT"], KINDS),
    "export OUT": (["export", "CKPT", "P"], ["file", "loop", "under a file", "proc", "empty string"]),
    "params": (["params", "P"], ["missing", "file", "empty folder", "loop", "under a file", "proc"]),
    "train --data": (["train", "--data", "P", "--max-steps", "1", "--out", "OUT"], KINDS),
    "train --out": (
        ["train", "--max-steps", "1", "--out", "P"],
        ["file", "loop", "under a file", "proc", "empty string"],
    ),
    "lab --docs": (
        ["lab", "recall", "--smoke", "--docs", "P"],
        ["file", "loop", "under a file", "proc", "empty string"],
    ),
    "plan": (["plan", "P"], ["missing", "file", "empty folder", "loop", "under a file", "proc"]),
}
CASES = [(name, kind) for name, (_, kinds) in COMMANDS.items() for kind in kinds]


@pytest.mark.parametrize("name, kind", CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_a_path_a_command_cannot_use_is_one_line(places, name, kind, tmp_path, capsys, monkeypatch):
    root, checkpoint, paths = places
    monkeypatch.setattr(lab, "run", lambda *a, **k: pytest.fail("k3 lab ran with an unusable --docs"))
    out = tmp_path / "out"
    argv = [
        paths[kind] if a == "P" else str(out) if a == "OUT" else str(checkpoint) if a == "CKPT" else a
        for a in COMMANDS[name][0]
    ]
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err.strip()
    lines = err.splitlines()
    assert code == 2, (argv, code, err)
    assert lines and lines[-1].startswith(f"k3 {argv[0]}"), err
    assert "Traceback" not in err and ".tmp" not in lines[-1], err
    assert len([line for line in lines if "error" in line]) == 1, err
    assert not out.exists() or not any(out.iterdir())
