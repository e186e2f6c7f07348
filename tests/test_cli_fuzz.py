"""A fuzzer that keeps the command line's numbers honest (issue 46, point 8): every numeric flag of every
subcommand either takes a value it can use (finite, in range) or refuses it with argparse's one-line error,
whatever text it is given; and `k3 plan`, cheap enough to run whole, ends in exit 0 or in one line and exit 2
for any mix of its numeric flags — never a traceback, never an absurd plan silently."""

from __future__ import annotations

import argparse
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3.cli import main
from k3.cli.parser import build_parser

NUMBERS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.integers(min_value=-3, max_value=5000).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(
        [
            "nan",
            "inf",
            "-inf",
            "1e999",
            "0x10",
            "1_000",
            " 7 ",
            "",
            "-0",
            "1e-300",
            "5e-324",
            "٣",
            "2**64",
            "18446744073709551616",
            "½",
        ]
    ),
    st.text(max_size=12),
)
FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _typed_actions(parser: argparse.ArgumentParser, path=()):
    """(subcommand path, option, action) of every option whose value goes through a converter."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _typed_actions(sub, path + (name,))
        elif action.option_strings and callable(action.type) and action.type is not str:
            yield path, action.option_strings[0], action


ACTIONS = list(_typed_actions(build_parser()))


def test_every_numeric_flag_is_found():
    flags = {(" ".join(path), option) for path, option, _ in ACTIONS}
    for expected in [
        ("train", "--seed"),
        ("generate", "--seed"),
        ("generate", "--max-new-tokens"),
        ("bench ops", "--T"),
        ("plan", "--gpus"),
        ("serve", "--threads"),
    ]:
        assert expected in flags, expected
    assert all(action.type not in (int, float) for _, _, action in ACTIONS), [
        f"{' '.join(p)} {o}" for p, o, a in ACTIONS if a.type in (int, float)
    ]  # a bare int() has no bounds


@FAST
@given(index=st.integers(min_value=0, max_value=len(ACTIONS) - 1), text=NUMBERS)
def test_a_numeric_flag_takes_a_usable_value_or_refuses_it(index, text):
    path, option, action = ACTIONS[index]
    try:
        value = action.type(text)
    except argparse.ArgumentTypeError as e:
        assert "\n" not in str(e), (option, str(e))
        return
    except (ValueError, TypeError):  # argparse turns these into "invalid <type> value: ..." (one line, exit 2)
        return
    if isinstance(value, float):
        assert math.isfinite(value), (path, option, text, value)
    if isinstance(value, int) and not isinstance(value, bool):
        assert value >= 0 or option in ("--lr",), (path, option, text, value)
        if option == "--seed":
            assert value < 2**64


def test_argparse_errors_are_one_line(capsys):
    for argv in (
        ["train", "--seed", "18446744073709551616"],
        ["generate", "--checkpoint", "x", "--seed", "-1"],
        ["bench", "ops", "--T", "0"],
        ["plan", "kimi-k3", "--gpus", str(10**12)],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"k3 {argv[0]}"), err


PLAN_FLAGS = ["--gpus", "--fsdp", "--ep", "--pp", "--seq-len", "--micro-batch", "--global-batch-tokens", "--mfu"]


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)  # capsys read each time
@given(
    flags=st.dictionaries(
        st.sampled_from(PLAN_FLAGS),
        st.one_of(
            st.integers(min_value=-5, max_value=4096).map(str),
            st.sampled_from(["1", "2", "8", "64", "1048576", "0.5", str(10**12), "nan", "-1", "x"]),
        ),
        max_size=4,
    ),
    model=st.sampled_from(["kimi-k3", "kimi-k3-tiny", "gpt2"]),
)
def test_k3_plan_ends_in_a_plan_or_one_line(flags, model, capsys):
    argv = ["plan", model, "--train"] + [part for flag, value in flags.items() for part in (flag, value)]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code in (0, 2), (argv, code, err)
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("k3 plan: error:"), (argv, err)
    else:
        assert "run it:" in out or "fits" in out


def test_plan_says_when_it_rounds_the_global_batch(capsys):
    assert main(["plan", "kimi-k3", "--train", "--gpus", "1024", "--global-batch-tokens", "1"]) == 0
    assert "--global-batch-tokens 1 rounded up to 4,194,304" in capsys.readouterr().out


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("k3 0.")
