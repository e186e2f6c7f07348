"""The Python API refuses what a new user gets wrong in one line naming the argument (before: a TypeError
from deep inside for `layers=3`, a truncated token id for `generate([[1.5]])`, a negative byte count for
`cache_bytes(-1, 5)`, "no such folder" for a file given to from_pretrained)."""

from __future__ import annotations

import pytest
import torch

from k3 import CausalLM, get_config


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("api") / "ckpt"
    torch.manual_seed(0)
    model = CausalLM(get_config("kimi-k3-tiny", vocab_size=64, hidden_size=32)).eval()
    model.save_pretrained(path)
    return model, path


@pytest.mark.parametrize("layers", [3, "01", {0: 1}])
def test_from_pretrained_layers_that_is_no_list_is_refused(saved, layers):
    with pytest.raises(
        ValueError, match=r"from_pretrained: `layers` must be a list or range of layer indices in \[0, 5\)"
    ):
        CausalLM.from_pretrained(saved[1], layers=layers)


def test_from_pretrained_layers_as_a_range_and_bools_refused(saved):
    assert CausalLM.from_pretrained(saved[1], layers=range(2)).config.num_layers == 2
    with pytest.raises(ValueError, match="`layers` must be distinct layer indices"):
        CausalLM.from_pretrained(saved[1], layers=[True])


def test_from_pretrained_of_a_file_says_it_is_a_file(saved):
    with pytest.raises(NotADirectoryError, match=r"config\.json is a file, not a checkpoint folder"):
        CausalLM.from_pretrained(saved[1] / "config.json")


def test_from_pretrained_of_an_unknown_device_names_it(saved):
    with pytest.raises(ValueError, match=r"from_pretrained: `device` must be a torch.device .* got 'bogus'"):
        CausalLM.from_pretrained(saved[1], device="bogus")


@pytest.mark.parametrize("prompt", [[[1.5]], [[1, 2.0]], [[True, False]], [torch.tensor([1.0])]])
def test_generate_refuses_token_ids_that_are_no_integers(saved, prompt):
    with pytest.raises(ValueError, match="generate: prompt 0 must hold integer token ids"):
        saved[0].generate(prompt, 1)


def test_generate_still_takes_integer_lists_and_tensors(saved):
    model = saved[0]
    out = model.generate([[1, 2], torch.tensor([3], dtype=torch.int32)], 1, temperature=0)
    assert [len(row) for row in out] == [3, 2] and out[0][:2].tolist() == [1, 2]


@pytest.mark.parametrize("args, name", [((-1, 5), "batch_size"), ((1, -5), "tokens"), ((1.5, 5), "batch_size")])
def test_cache_bytes_refuses_negative_sizes(saved, args, name):
    with pytest.raises(ValueError, match=f"cache_bytes: `{name}` must be an int >= 0"):
        saved[0].cache_bytes(*args)
    assert saved[0].cache_bytes(0, 5) == 0 and saved[0].cache_bytes(2, 5) > saved[0].cache_bytes(1, 5) > 0
