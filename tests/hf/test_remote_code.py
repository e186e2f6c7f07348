"""An export in k3's format loads in an interpreter that never imported k3, through transformers' remote
code (config.json's auto_map -> configuration_k3.py / modeling_k3.py, which import k3.hf): AutoConfig,
AutoModelForCausalLM, pipeline and AutoTokenizer with `trust_remote_code=True`. Checked in a
subprocess (offline, its own HF_HOME for the modules transformers copies): k3's logits (float32, to
rounding) and greedy tokens (float64, where two code paths' rounding cannot flip an argmax), a save
that keeps the remote code, and the ImportError that says how to install k3 when it is missing."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from k3.cli import main  # noqa: E402
from k3.hf.remote_code import AUTO_MAP, REMOTE_CODE_FILES  # noqa: E402

from .test_export import TEXT, training_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NEW_TOKENS = 12

# runs in a fresh interpreter: argv = export folder, results file
SCRIPT = r"""
import os, sys
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, pipeline

folder, results = sys.argv[1], sys.argv[2]
sys.modules["k3"] = None  # k3 "not installed": the remote code says what to install
try:
    AutoConfig.from_pretrained(folder, trust_remote_code=True)
    missing = None
except ImportError as e:
    missing = str(e)
del sys.modules["k3"]
assert not any(name == "k3" or name.startswith("k3.") for name in sys.modules), "k3 imported too early"

config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
ids = tokenizer(sys.argv[3], return_tensors="pt").input_ids
with torch.no_grad():
    logits = model(ids).logits
model64 = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float64).eval()
greedy = model64.generate(ids, do_sample=False, max_new_tokens=int(sys.argv[4]))
generator = pipeline("text-generation", model=folder, trust_remote_code=True, dtype=torch.float64)
piped = generator(sys.argv[3], do_sample=False, max_new_tokens=int(sys.argv[4]), return_tensors=True)
model.save_pretrained(os.path.join(os.path.dirname(results), "saved_again"))
torch.save({"missing": missing, "config_module": type(config).__module__, "ids": ids, "logits": logits,
            "greedy": greedy, "piped": piped[0]["generated_token_ids"]}, results)
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(k3 model, tokenizer, the folder `k3 export` wrote)."""
    path = tmp_path_factory.mktemp("remote")
    model, tokenizer = training_checkpoint(path / "run", "kimi-k3-tiny", hidden_size=64, num_layers=2)
    assert main(["export", str(path / "run"), str(path / "hf")]) == 0
    return model, tokenizer, path / "hf"


def test_export_names_its_remote_code(exported):
    _, _, folder = exported
    config = json.loads((folder / "config.json").read_text())
    assert (
        config["auto_map"]
        == {"AutoConfig": "configuration_k3.K3Config", "AutoModelForCausalLM": "modeling_k3.K3ForCausalLM"}
        == AUTO_MAP
    )
    assert config["architectures"] == ["K3ForCausalLM"] and config["model_type"] == "k3"
    assert all((folder / name).is_file() for name in REMOTE_CODE_FILES)


def test_fresh_interpreter_loads_the_export_with_trust_remote_code(exported, tmp_path):
    model, tokenizer, folder = exported
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "HF_HOME": str(tmp_path / "hf_home"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    results = tmp_path / "results.pt"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(folder), str(results), TEXT, str(NEW_TOKENS)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    got = torch.load(results)

    assert "k3 export" in got["missing"] and "pip install 'k3[hf]'" in got["missing"], got["missing"]
    assert got["config_module"].startswith("transformers_modules.")  # the folder's configuration_k3.py
    ids = got["ids"]
    assert ids[0].tolist() == tokenizer.encode(TEXT)
    with torch.no_grad():
        torch.testing.assert_close(got["logits"], model(ids), rtol=1e-5, atol=1e-6)
    expected = copy.deepcopy(model).double().generate(ids, NEW_TOKENS, temperature=0, eos_token_id=tokenizer.eot_id)
    assert torch.equal(got["greedy"], expected)
    assert got["piped"] == expected[0].tolist()
    # a model loaded through the remote code saves with it again
    again = tmp_path / "saved_again"
    assert json.loads((again / "config.json").read_text())["auto_map"] == AUTO_MAP
    assert all((again / name).read_bytes() == (folder / name).read_bytes() for name in REMOTE_CODE_FILES)
