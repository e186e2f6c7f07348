"""What a new user's first runs of the command line got wrong, each now refused (or read) in one line
naming the setting: an environment switch that is no switch, `k3 params --json` without a model."""

from __future__ import annotations

import json

import pytest
import torch

from k3.checkpoints.checkpoint import read_config
from k3.cli import main
from k3.models import PRESETS, CausalLM, ModelConfig, get_config
from k3.runtime import env_switch, keep_freed_memory
from k3.tokenizer import byte_tokenizer

BOM = "\ufeff"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("inputs") / "ckpt"
    torch.manual_seed(0)
    CausalLM(get_config("kimi-k3-tiny", vocab_size=257, hidden_size=32)).save_pretrained(path)
    byte_tokenizer().save(path / "tokenizer.json")
    return path


def one_error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert err.startswith(f"k3 {command}: error: ")
    return err


@pytest.mark.parametrize("value", ["abc", "2", "enable"])
def test_keep_freed_memory_refuses_a_value_that_is_no_switch(monkeypatch, capsys, value):
    """Before: any value but "0" (abc included) was taken as on."""
    monkeypatch.setenv("K3_KEEP_FREED_MEMORY", value)
    with pytest.raises(ValueError, match=f"K3_KEEP_FREED_MEMORY must be 1 or 0 .* got '{value}'"):
        keep_freed_memory()
    assert main(["params", "kimi-k3-tiny"]) == 2
    assert "K3_KEEP_FREED_MEMORY" in one_error_line(capsys, "params")


@pytest.mark.parametrize("value, on", [("0", False), ("off", False), (" No ", False), ("1", True), ("TRUE", True)])
def test_env_switch_reads_the_usual_spellings(monkeypatch, value, on):
    monkeypatch.setenv("K3_TEST_SWITCH", value)
    assert env_switch("K3_TEST_SWITCH", default=not on) is on
    monkeypatch.setenv("K3_TEST_SWITCH", "")
    assert env_switch("K3_TEST_SWITCH", default=on) is on
    monkeypatch.setenv("K3_KEEP_FREED_MEMORY", value)
    if not on:
        assert keep_freed_memory() is False


def test_params_json_without_a_model_lists_the_presets_as_json(capsys):
    """Before: `k3 params --json` printed the plain-text list."""
    assert main(["params", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"presets": list(PRESETS)}
    assert main(["params"]) == 0
    assert capsys.readouterr().out.startswith("presets: gpt2")


def test_params_vs_without_a_model_is_refused(capsys):
    assert main(["params", "--vs", "gpt2"]) == 2
    assert "--vs gpt2" in one_error_line(capsys, "params")


def test_a_bom_in_the_prompt_file_is_not_part_of_the_prompt(checkpoint, tmp_path, capsys):
    """Before: the BOM's three bytes were three more prompt tokens (5 instead of 2 for "to")."""
    outputs = []
    for name, text in (("plain.txt", "to\n"), ("bom.txt", BOM + "to\n")):
        (tmp_path / name).write_text(text, encoding="utf-8")
        argv = ["generate", "--checkpoint", str(checkpoint), "--prompt-file", str(tmp_path / name)]
        assert main([*argv, "--max-new-tokens", "3", "--temperature", "0"]) == 0
        out, err = capsys.readouterr()
        assert "(2 to 2 tokens)" in err
        outputs.append(out)
    assert outputs[0] == outputs[1] and BOM not in outputs[1]


def test_a_config_json_with_a_bom_reads(checkpoint, tmp_path):
    """Before: refused as not JSON (Notepad writes the BOM)."""
    import shutil

    copy = tmp_path / "bom"
    shutil.copytree(checkpoint, copy)
    raw = (copy / "config.json").read_text(encoding="utf-8")
    (copy / "config.json").write_text(BOM + raw, encoding="utf-8")
    assert read_config(copy, ModelConfig)[0] == read_config(checkpoint, ModelConfig)[0]
    assert CausalLM.from_pretrained(copy).config.vocab_size == 257


@pytest.mark.parametrize("target, said", [("/dev/null", "is not a regular file"), ("FOLDER", "is a folder")])
def test_a_prompt_file_that_is_no_regular_file_is_called_what_it_is(checkpoint, tmp_path, capsys, target, said):
    """Before: "no such file" for both."""
    target = str(tmp_path) if target == "FOLDER" else target
    assert main(["generate", "--checkpoint", str(checkpoint), "--prompt-file", target]) == 2
    assert f"--prompt-file {target}: {said}" in one_error_line(capsys, "generate")


@pytest.mark.parametrize(
    "argv, command",
    [
        (["generate", "--checkpoint", "FILE", "--prompt", "to"], "generate"),
        (["export", "FILE", "OUT"], "export"),
        (["lab", "inspect", "--checkpoint", "FILE"], "lab"),
    ],
)
def test_a_file_given_for_a_checkpoint_folder_is_called_a_file(checkpoint, tmp_path, capsys, argv, command):
    """Before: "no such folder" for a file that exists."""
    argv = [
        str(checkpoint / "config.json") if a == "FILE" else str(tmp_path / "out") if a == "OUT" else a for a in argv
    ]
    assert main(argv) == 2
    assert "config.json: is a file, not a checkpoint folder" in one_error_line(capsys, command)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_a_checkpoint_file_that_is_a_folder_is_called_a_folder(checkpoint, tmp_path, capsys, name):
    """Before: safetensors' "No such device (os error 19)" for model.safetensors, errno 21 for config.json."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(checkpoint, copy)
    (copy / name).unlink()
    (copy / name).mkdir()
    assert main(["generate", "--checkpoint", str(copy), "--prompt", "to"]) == 2
    assert f"{name} is a folder" in one_error_line(capsys, "generate")
    with pytest.raises(ValueError, match=f"{name} is a folder"):
        CausalLM.from_pretrained(copy)
