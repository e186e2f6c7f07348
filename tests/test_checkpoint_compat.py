"""Checkpoints written by an earlier k3 still load and resume.

tests/fixtures/main-0138790/ holds two training checkpoints (`k3 train --out`) written by k3 at commit
0138790, before the package was restructured: a Kimi K3 (Block AttnRes, KDA, gated MLA, latent MoE) and
a GPT-2 (tied head, learned positions), both narrowed to width 16 and trained 3 steps on tests/corpus.py's
corpus (4 documents of 300 words), byte tokenizer, one thread. Beside each, reference_logits.pt holds
what that k3 computed from the checkpoint: full-sequence logits, and the logits of a 7-token prefill
followed by 4 decode steps. The losses below are that k3's, resuming each checkpoint to step 5.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from k3.models import CausalLM
from k3.training import TrainConfig, train

from .corpus import write_corpus

FIXTURES = Path(__file__).parent / "fixtures" / "main-0138790"
# k3 at 0138790: `train(TrainConfig(max_steps=5), resume=...)` on each checkpoint (losses of steps 1-5;
# validation bits per byte at steps 3 and 5)
RESUMED = {
    "kimi-k3-tiny": (
        [5.562506675720215, 5.545634746551514, 5.480974197387695, 5.451182842254639, 5.411052227020264],
        [7.864296767354082, 7.78413634171753],
    ),
    "gpt2-tiny": (
        [5.5601091384887695, 5.490691184997559, 5.411683559417725, 5.372878074645996, 5.309290885925293],
        [7.718758856818543, 7.635416752141029],
    ),
}


@pytest.mark.parametrize("preset", list(RESUMED))
def test_an_earlier_checkpoint_loads_and_computes_what_it_did(preset):
    model = CausalLM.from_pretrained(FIXTURES / preset).eval()
    ref = torch.load(FIXTURES / preset / "reference_logits.pt", weights_only=True)
    ids = ref["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref["logits"], rtol=1e-5, atol=1e-5)
        cache = model.new_cache(ids.shape[0])
        model(ids[:, :7], cache=cache)
        steps = torch.cat([model(ids[:, t : t + 1], cache=cache) for t in range(7, ids.shape[1])], dim=1)
    torch.testing.assert_close(steps, ref["decode_logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", list(RESUMED))
def test_an_earlier_training_checkpoint_resumes_as_it_did(preset, tmp_path):
    (tmp_path / "corpus").mkdir()
    write_corpus(tmp_path / "corpus", docs=4, words=300)
    run = tmp_path / preset
    shutil.copytree(FIXTURES / preset, run)
    saved = json.loads((run / "config.json").read_text())
    saved["train"]["data"] = str(tmp_path / "corpus")  # the corpus was written to a folder of the machine that made it
    (run / "config.json").write_text(json.dumps(saved))
    history = train(TrainConfig(max_steps=5), resume=str(run), progress=False)
    losses, val_bpb = RESUMED[preset]
    assert history["step"] == [1, 2, 3, 4, 5]
    torch.testing.assert_close(torch.tensor(history["loss"]), torch.tensor(losses), rtol=1e-4, atol=0)
    torch.testing.assert_close(torch.tensor(history["val_bpb"]), torch.tensor(val_bpb), rtol=1e-4, atol=0)
