"""Clear errors at the Python API and the CLI for the cases a hostile new-user pass found (issue 46, point 9):
each was a traceback of an internal error (AttributeError, IndexError, "Invalid device string",
ModuleNotFoundError, SafetensorError) and is now one message naming the argument, what it expects and what
it got."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from k3 import CausalLM, get_config
from k3.cli import main
from k3.tokenizer import byte_tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("trust")
    torch.manual_seed(0)
    CausalLM(get_config("kimi-k3-tiny", vocab_size=257, hidden_size=32)).save_pretrained(path)
    byte_tokenizer().save(path / "tokenizer.json")
    return path


def test_causal_lm_of_a_preset_name_says_how():
    with pytest.raises(
        TypeError,
        match=r"CausalLM takes a ModelConfig, got str 'kimi-k3-tiny': "
        r"CausalLM\(get_config\('kimi-k3-tiny'\)\)",
    ):
        CausalLM("kimi-k3-tiny")


@pytest.mark.parametrize("depth", [0, -1, 2.5, True])
def test_get_config_num_layers_below_one(depth):
    with pytest.raises(ValueError, match=r"`num_layers` must be an int >= 1, got"):
        get_config("kimi-k3-tiny", num_layers=depth)


@pytest.mark.parametrize(
    "name, dtype",
    [
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("torch.float64", torch.float64),
        (torch.float16, torch.float16),
        ("fp32", torch.float32),
    ],
)
def test_from_pretrained_takes_dtype_names(checkpoint, name, dtype):
    assert CausalLM.from_pretrained(checkpoint, dtype=name).lm_head.weight.dtype == dtype


@pytest.mark.parametrize("bad", ["bf17", "int8", torch.int64, 3])
def test_from_pretrained_refuses_other_dtypes_by_name(checkpoint, bad):
    with pytest.raises(ValueError, match=r"from_pretrained: `dtype` must be a floating torch.dtype or one of "):
        CausalLM.from_pretrained(checkpoint, dtype=bad)


def test_python_m_k3_eval_without_the_extra_is_one_line():
    # a fresh interpreter in which lm-eval cannot be imported (this one may have imported it already)
    code = "import runpy, sys; sys.modules['lm_eval'] = None; runpy.run_module('k3.eval', run_name='__main__')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        "python -m k3.eval: error: lm-evaluation-harness is not installed; pip install 'k3[eval]' (or lm-eval)"
    )


def test_export_on_a_full_disk_is_one_line_and_leaves_nothing(checkpoint, tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    import safetensors.torch
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        raise SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        )

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    monkeypatch.setattr("transformers.modeling_utils.safe_save_file", full, raising=False)
    out = tmp_path / "exported"
    assert main(["export", str(checkpoint), str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"k3 export: error: export: could not write the files for {out}: SafetensorError")
    assert "No space left on device" in err[-1] and "nothing was written there" in err[-1]
    assert not out.exists() or not any(out.iterdir())
    assert not [p for p in tmp_path.iterdir() if p.name != "exported"]  # no staging folder left


@pytest.mark.parametrize("command", [["train"], ["generate", "--checkpoint", "x", "--prompt", "a"]])
@pytest.mark.parametrize("seed", [str(2**64), "-1", "1.5"])
def test_seed_outside_the_generators_range_names_the_flag(command, seed, capsys):
    assert main([*command, "--seed", seed]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        f"k3 {command[0]}: error: argument --seed: expected a seed, an integer in "
        f"[0, 18446744073709551615], got '{seed}'"
    )


@pytest.mark.parametrize(
    "field, value",
    [
        ("norm_eps", -1.0),
        ("norm_eps", 0.0),
        ("situ_beta", float("nan")),
        ("routed_scaling_factor", float("inf")),
        ("rope_theta", -5.0),
    ],
)
def test_config_numbers_that_cannot_work_are_refused(field, value):
    with pytest.raises(ValueError, match=f"`{field}` must be"):
        get_config("kimi-k3-tiny", **{field: value})


@pytest.mark.parametrize("eos", ["x", -1, 10**6, 1.0])
def test_generate_refuses_an_eos_that_is_no_token(eos):
    model = CausalLM(get_config("kimi-k3-tiny", vocab_size=257, hidden_size=32))
    with pytest.raises(ValueError, match=r"`eos_token_id` must be None or a token id in \[0, 257\)"):
        model.generate(torch.tensor([[1, 2]]), 3, eos_token_id=eos)


def test_generate_on_a_meta_model_says_what_to_do():
    with torch.device("meta"):
        model = CausalLM(get_config("kimi-k3-tiny", vocab_size=257, hidden_size=32))
    with pytest.raises(ValueError, match=r"weights are on the meta device .*CausalLM.from_pretrained"):
        model.generate(torch.tensor([[1, 2]]), 3)
