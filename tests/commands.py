"""Running `k3` commands in the tests: one that must fail as the CLI promises."""

from __future__ import annotations

from k3.cli import main


def fails(capsys, argv: list[str], *expected: str) -> str:
    """main(argv) exits with 2 and one line on stderr, `k3 <command>: error: ...`, holding `expected`;
    returns that line."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"k3 {argv[0]}: error: "), err
    for text in expected:
        assert text in err, err
    return err
