"""What several `k3` commands do alike when they run: torch's threads from --threads (`use_threads`), a size
flag read as bytes (`size_flag`), and `NAME`, `PARSER`, `add_arguments`, `run`: the interface every command module of
k3.cli has (`Command`, which `k3.cli.parser.build_parser` loops over)."""

from __future__ import annotations

import argparse
import sys
from typing import Protocol


class Command(Protocol):
    """A `k3` subcommand, one module each (k3/cli/train.py, ...; `k3 bench`'s are k3/cli/bench/*.py; vLLM's
    CLISubcommand): its parser is named `NAME` and made with `PARSER`'s keywords (help, description, ...),
    `add_arguments(parser)` adds its arguments, `run(args)` does the work and returns the exit code
    (`k3.cli.common.add_command` puts them together)."""

    NAME: str
    PARSER: dict

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def add_command(subparsers, command) -> argparse.ArgumentParser:
    """`command`'s subparser (named `NAME`, made with `PARSER`'s keywords) in `subparsers`, its arguments
    added by `add_arguments`, its `func` default the command's `run`; returned."""
    parser = subparsers.add_parser(command.NAME, **command.PARSER)
    command.add_arguments(parser)
    parser.set_defaults(func=command.run)
    return parser


def use_threads(args) -> None:
    """torch's threads from --threads, when given; a warning on stderr when they outnumber the cores, a
    ValueError past `max_threads()` (a parser whose --threads is not argtypes' THREADS still gets the bound)."""
    if args.threads:
        import os

        import torch

        from ..training.config import max_threads, threads_bound_words

        if args.threads > max_threads():
            raise ValueError(
                f"--threads {args.threads}: expected torch threads, an integer in [1, {max_threads()}] "
                f"({threads_bound_words()})"
            )
        cores = os.cpu_count()
        if cores and args.threads > cores:
            print(
                f"k3 {args.command}: warning: --threads {args.threads} is more than this machine's {cores} cores; "
                f"threads beyond the cores wait for each other and slow the work down (default: all cores)",
                file=sys.stderr,
            )
        torch.set_num_threads(args.threads)


def size_flag(text: str, flag: str) -> int:
    """A size flag's bytes (`k3.serve.parse_bytes`), its error naming the flag."""
    from ..serve import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None
