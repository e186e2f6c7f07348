"""`k3 plan ... --json` parses, every figure with a value and a unit."""

import json

import pytest

from k3.cli import main
from tests.commands import fails


def _json(capsys, *argv):
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_train_and_serve_json(capsys):
    train = _json(capsys, "kimi-k3-tiny", "--gpus", "4", "--mfu", "0.3")
    assert train["inputs"]["gpus"] == 4 and "ep" in train["chosen_by_planner"]
    assert all(set(v) == {"value", "unit"} for v in train["figures"].values())
    assert train["figures"]["memory per GPU"]["unit"] == "bytes"
    serve = _json(capsys, "kimi-k3-tiny", "--serve", "--context", "8192")
    assert serve["figures"]["cache per sequence"]["unit"] == "bytes"


def test_bad_model_is_a_clear_error(capsys):
    assert main(["plan", "no-such-model"]) == 2
    assert "neither a preset" in capsys.readouterr().err


def test_config_dir(capsys, tmp_path):
    """A directory with a k3 config.json plans like its preset."""
    from k3.models import get_config

    (tmp_path / "config.json").write_text(json.dumps({"k3": get_config("kimi-k3-tiny").to_dict()}))
    from_dir = _json(capsys, str(tmp_path), "--serve")
    from_preset = _json(capsys, "kimi-k3-tiny", "--serve")
    assert from_dir["figures"] == from_preset["figures"]


@pytest.mark.parametrize(
    "flags, blame",
    [
        (["--pp", "1000"], "--pp (1000) must divide --gpus (8): --fsdp is --gpus / --pp"),
        (["--pp", "3"], "--pp (3) must divide --gpus (8)"),
        (["--fsdp", "3"], "--fsdp (3) must divide --gpus (8): --pp is --gpus / --fsdp"),
        (["--pp", "16", "--fsdp", "1"], "--gpus (8) must equal --pp x --fsdp (16 x 1)"),
    ],
)
def test_a_layout_that_does_not_divide_blames_the_flag_given(capsys, flags, blame):
    fails(capsys, ["plan", "kimi-k3", "--gpus", "8", *flags], blame)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["kimi-k3-tiny", "--serve", "--fsdp", "4", "--mfu", "0.3"],
            "--fsdp, --mfu: a flag of --train plans, not of --serve",
        ),
        (["kimi-k3-tiny", "--context", "8192"], "--context: a flag of --serve plans, not of --train"),
        (["--published", "--gpus", "4"], "--gpus: a flag of --train or --serve plans, not of --published"),
        (["kimi-k3-tiny", "--published"], "give no model (got 'kimi-k3-tiny')"),
    ],
)
def test_a_flag_the_chosen_plan_does_not_read_is_refused(capsys, argv, expected):
    fails(capsys, ["plan", *argv], expected)


def test_defaults_left_out_are_the_documented_ones(capsys):
    given = _json(capsys, "kimi-k3-tiny", "--seq-len", "4096", "--micro-batch", "1", "--mfu", "0.4", "--gpu", "h200")
    assert given == _json(capsys, "kimi-k3-tiny")
