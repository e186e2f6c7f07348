"""What a new user's first runs of the command line got wrong, each now refused (or read) in one line
naming the setting: an environment switch that is no switch, `k3 params --json` without a model."""

from __future__ import annotations

import json

import pytest

from k3.cli import main
from k3.models import PRESETS
from k3.runtime import env_switch, keep_freed_memory


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
