"""`k3 serve` against its own /openapi.json with schemathesis's command line (`--checks all`, positive and
negative data, every phase): every status, body and bound the server answers with is what its schema states.
The app runs in this process (a ServerThread on a free port) over a tiny, fast model.

One thing no JSON Schema can state is left out of the generated requests: a prompt whose *tokens* pass the
model's length (schema_hooks.py drops it before it is sent, counting tokens as the server does); the server's
answer to such a prompt, 400 naming it, is tested in test_server_errors.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3.models import CausalLM, get_config
from k3.serve import Engine, ServerThread, build_app
from k3.tokenizer import byte_tokenizer

pytest.importorskip("schemathesis")

MAX_MODEL_LEN = 96


def test_the_server_answers_as_its_schema_says(tmp_path):
    torch.manual_seed(0)
    model = CausalLM(get_config("gpt2-tiny", vocab_size=257, hidden_size=32, max_position_embeddings=128)).eval()
    engine = Engine(model, cache_memory=10**9, max_running=32, max_length=MAX_MODEL_LEN, prefill_chunk=64)
    app = build_app(engine, byte_tokenizer(), "tiny", max_model_len=MAX_MODEL_LEN)
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": "tests.serve.schema_hooks",
        "K3_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    with ServerThread(app, engine) as server:
        command = [sys.executable, "-m", "schemathesis.cli", "run", server.url + "/openapi.json", "--checks", "all"]
        command += ["--max-examples", "25", "--seed", "1", "--workers", "1", "--generation-database", "none"]
        run = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
