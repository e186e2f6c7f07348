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


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_from_pretrained_onto_a_device_this_torch_cannot_use_says_so(saved):
    with pytest.raises(ValueError, match=r"`device` 'cuda:1', but this PyTorch .* cannot use cuda here"):
        CausalLM.from_pretrained(saved[1], device="cuda:1")  # (was torch's 'Torch not compiled with CUDA enabled')


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


@pytest.mark.parametrize(
    "change, field, fix",
    [
        ({"max_position_embeddings": 4}, "`max_position_embeddings` 4 (learned positions)", "null"),
        ({"norm": "layernorm"}, "`norm` 'layernorm' (LayerNorm)", "`norm` 'rmsnorm'"),
    ],
)
def test_a_gpt2_part_on_another_model_names_the_field(change, field, fix):
    """Before: "LayerNorm, GELU MLP and learned positions are GPT-2's" whichever was set."""
    with pytest.raises(ValueError, match="built for 'mha' layers only") as e:
        get_config("kimi-k3-tiny", **change)
    message = str(e.value)
    assert message.startswith(f"ModelConfig('kimi-k3-tiny'): {field}: GPT-2's") and fix in message
    assert "GELU" not in message and "'kda', 'mla'" in message
    assert get_config("gpt2-tiny", **change).layer_types[0] == "mha"


@pytest.mark.parametrize("where, said", [("/proc/k3-no-such/x", "cannot make the folder"), ("FILE", "is a file")])
def test_the_compile_cache_names_its_environment_variable(monkeypatch, tmp_path, where, said):
    """Before: "[Errno 2] No such file or directory: '/proc/x'" from inductor, naming no variable."""
    from k3.inference.decode_step import compile_cache_dir

    if where == "FILE":
        where = str(tmp_path / "file")
        (tmp_path / "file").write_text("")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", where)
    with pytest.raises(ValueError, match=f"the environment variable TORCHINDUCTOR_CACHE_DIR={where}: {said}"):
        compile_cache_dir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    assert compile_cache_dir() == tmp_path / "cache" and (tmp_path / "cache").is_dir()


def test_gguf_export_of_a_byte_tokenizer_says_what_can_be_done():
    """Before: it suggested exporting "without a tokenizer", which no flag does."""
    pytest.importorskip("gguf")
    from k3.checkpoints.gguf_format import add_tokenizer
    from k3.tokenizer import byte_tokenizer

    with pytest.raises(ValueError, match="has no merges") as e:
        add_tokenizer(None, byte_tokenizer(), 257)
    assert "--format k3" in str(e.value) and "without its tokenizer.json" in str(e.value)


@pytest.mark.parametrize("bad", [300, -1])
def test_a_forward_of_an_id_outside_the_vocabulary_names_input_ids(bad):
    model = CausalLM(get_config("kimi-k3-tiny", vocab_size=257, num_layers=2, layer_types=["kda", "mla"]))
    with pytest.raises(ValueError, match=r"`input_ids` must be token ids in \[0, 257\) \(the vocabulary\), got ids"):
        model(torch.tensor([[1, 2, bad]]))  # (was torch's 'IndexError: index out of range in self')
