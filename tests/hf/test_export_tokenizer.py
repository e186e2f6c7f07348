"""An export's tokenizer loads with transformers' own fast tokenizer class, in a fresh interpreter that
never imported k3, with stdin empty: nothing prompts, and it encodes and decodes like k3's Tokenizer.

AutoTokenizer.from_pretrained reads config.json through AutoConfig before the tokenizer's files. The
Kimi Linear format (model_type "kimi_linear", known to transformers) loads with no flag, no prompt and
no "You are using a model of type ..." warning; so does the k3 format (model_type "k3", which only the
export's remote code or `import k3.hf` registers) with `trust_remote_code=True` (the flag its model
needs too) or after `import k3.hf`. The Kimi K3 format (model_type "kimi_k3", which transformers 5.24
does not know and the export carries no code for) loads with no flag and no prompt; the tokenizer
itself is never remote code (tokenizer_config.json names PreTrainedTokenizerFast, no auto_map)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from k3.hf.export import export  # noqa: E402
from tests.hf.test_export import TEXT, training_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Do you wish to run the custom code?"
WARNING = "You are using a model of type"
SAMPLE = TEXT + "<|endoftext|> to be"
# each case: a marker line, then the load (its logs and any prompt land in between), then the result
SCRIPT = r"""
import json, sys
import transformers

cases, sample = json.loads(sys.argv[1]), sys.argv[2]
for name, folder, kwargs, import_k3 in cases:
    print("=== " + name, flush=True)
    if import_k3:
        import k3.hf  # registers model_type "k3"
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, **kwargs)
    ids = tokenizer(sample).input_ids
    print("RESULT " + json.dumps({"class": type(tokenizer).__name__, "module": type(tokenizer).__module__,
                                  "ids": ids, "text": tokenizer.decode(ids), "eos": tokenizer.eos_token_id}),
          flush=True)
"""


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{format: export folder}, each with the tokenizer of the checkpoint it came from, and that tokenizer."""
    root = tmp_path_factory.mktemp("export_tokenizer")
    _, tokenizer = training_checkpoint(root / "k3run", "kimi-k3-tiny", hidden_size=64, num_layers=2)
    training_checkpoint(root / "klrun", "kimi-linear-tiny", hidden_size=64, num_layers=2)
    folders = {}
    for format, run in (("k3", "k3run"), ("kimi-k3", "k3run"), ("kimi-linear", "klrun")):
        folders[format] = root / format
        export(root / run, folders[format], format=format)
    return folders, tokenizer


def load_in_fresh_interpreter(cases, tmp_path) -> dict[str, tuple[str, dict]]:
    """Run SCRIPT on `cases` with stdin empty and offline -> {case: (its output, its result)}; stdout and
    stderr together, so a prompt (stdout) and transformers' logs (stderr) are both seen."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "HF_HOME": str(tmp_path / "hf_home"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(cases), SAMPLE],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:]
    out = {}
    for part in done.stdout.split("=== ")[1:]:
        name, _, rest = part.partition("\n")
        before, _, result = rest.rpartition("RESULT ")
        out[name] = (before + result.partition("\n")[2], json.loads(result.partition("\n")[0]))
    assert sorted(out) == sorted(c[0] for c in cases), done.stdout[-4000:]
    return out


def test_exported_tokenizers_load_without_remote_code_or_a_prompt(exports, tmp_path):
    folders, tokenizer = exports
    for folder in folders.values():
        settings = json.loads((folder / "tokenizer_config.json").read_text())
        assert settings["tokenizer_class"] == "PreTrainedTokenizerFast" and "auto_map" not in settings
        assert "AutoTokenizer" not in json.loads((folder / "config.json").read_text()).get("auto_map", {})
    cases = [
        ("kimi-linear", str(folders["kimi-linear"]), {}, False),
        ("kimi-k3", str(folders["kimi-k3"]), {}, False),
        ("k3, trust_remote_code", str(folders["k3"]), {"trust_remote_code": True}, False),
        ("k3, import k3.hf", str(folders["k3"]), {}, True),
    ]  # last: the import registers "k3" for good
    results = load_in_fresh_interpreter(cases, tmp_path)
    ids = tokenizer.encode(SAMPLE)
    for name, (output, got) in results.items():
        assert PROMPT not in output, (name, output)
        assert got["module"].startswith("transformers.") and got["class"] in (
            "PreTrainedTokenizerFast",
            "TokenizersBackend",
        ), (name, got)
        assert got["ids"] == ids and got["text"] == tokenizer.decode(ids) == SAMPLE, name
        assert got["eos"] == tokenizer.eot_id, name
        if name != "kimi-k3":  # transformers 5.24 does not know model_type "kimi_k3" (see the docstring)
            assert WARNING not in output, (name, output)
