"""`k3 bench`: benchmarks, one subcommand each (`k3 bench ops`, ...), and one module each in this package
with the interface of every `k3` command module (`k3.cli.common.Command`: `NAME`, `PARSER`, `add_arguments`,
`run`); `k3 bench` adds their parsers and runs the one named."""

from __future__ import annotations

import argparse

from ..common import add_command
from . import backward, gpu, llama, models, ops, parallel, profile, serve, train

NAME = "bench"
SUBCOMMANDS = (ops, backward, profile, train, parallel, gpu, models, serve, llama)  # in `k3 bench --help`'s order


PARSER = {"help": "benchmarks (ratios measured side by side in one run)"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`k3 bench`'s subcommands, added to its `parser`."""
    bench_sub = parser.add_subparsers(dest="bench", required=True)
    for command in SUBCOMMANDS:
        add_command(bench_sub, command)


def run(args) -> int:
    """The subcommand `args.bench` names."""
    return next(command for command in SUBCOMMANDS if command.NAME == args.bench).run(args)
