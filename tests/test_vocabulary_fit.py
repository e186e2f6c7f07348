"""A tokenizer that does not fit the model is refused at load, in one line naming the folder and both sizes
(before: a k3 checkpoint whose tokenizer.json had 257 byte tokens beside a model of 4096 generated garbage
without a word, and the reverse was refused only at the first token out of range).

A k3 training checkpoint (config.json has the run's "train" record) trains the two together: the sizes
must be equal. Any other folder (an export, a Hub checkpoint) may pad the model's vocabulary past the
tokenizer's, never the reverse."""

from __future__ import annotations

import json

import pytest
import torch

from k3 import CausalLM, get_config
from k3.cli import main
from k3.cli.preflight import check_checkpoint, check_pretrained
from k3.tokenizer import byte_tokenizer


def folder(tmp_path, name: str, vocab_size: int, training: bool):
    """A checkpoint of a model with `vocab_size` beside the 257-token byte tokenizer."""
    path = tmp_path / name
    torch.manual_seed(0)
    CausalLM(get_config("kimi-k3-tiny", vocab_size=vocab_size, hidden_size=32)).save_pretrained(path)
    byte_tokenizer().save(path / "tokenizer.json")
    if training:
        raw = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**raw, "train": {"tokenizer": "byte"}}))
    return path


@pytest.mark.parametrize("vocab_size", [256, 300])
def test_a_training_checkpoint_needs_the_tokenizer_of_its_size(tmp_path, vocab_size):
    path = folder(tmp_path, "run", vocab_size, training=True)
    for check in (check_checkpoint, check_pretrained):
        with pytest.raises(
            ValueError, match=f"tokenizer.json has 257 tokens but the model's vocab_size .* is {vocab_size}"
        ):
            check(path, "--checkpoint run")


def test_a_training_checkpoint_of_equal_sizes_passes(tmp_path):
    assert check_checkpoint(folder(tmp_path, "run", 257, training=True)).vocab_size == 257


def test_elsewhere_a_padded_model_vocabulary_passes_and_a_smaller_one_is_refused(tmp_path):
    assert check_checkpoint(folder(tmp_path, "padded", 320, training=False)).vocab_size == 320
    with pytest.raises(ValueError, match="tokenizer.json has 257 tokens, more than the model's vocab_size of 200"):
        check_pretrained(folder(tmp_path, "small", 200, training=False))


def test_generate_refuses_the_mismatch_before_printing(tmp_path, capsys):
    path = folder(tmp_path, "run", 300, training=True)
    assert main(["generate", "--checkpoint", str(path), "--prompt", "to be", "--max-new-tokens", "2"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"k3 generate: error: --checkpoint {path}: tokenizer.json has 257 tokens")
