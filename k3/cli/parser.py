"""The `k3` command line's parser: one subcommand per command module of k3.cli (`COMMANDS`, each with `NAME`,
`PARSER`, `add_arguments` and `run`: `k3.cli.common.Command`), each number checked as it is parsed."""

from __future__ import annotations

import argparse

from .. import __version__
from . import bench, export, generate, lab, params, plan, serve, train
from . import eval as lm_eval
from .argtypes import Parser
from .common import add_command

COMMANDS = (train, generate, serve, export, params, plan, bench, lab, lm_eval)  # in `k3 --help`'s order


def _torch_version() -> str:
    import torch

    return torch.__version__


def build_parser() -> argparse.ArgumentParser:
    """`k3`'s whole parser: every command's subparser, whose `func` default is the command's `run`."""
    parser = Parser(prog="k3", description="Kimi K3 and its lineage in PyTorch.")
    parser.add_argument("--version", action="version", version=f"k3 {__version__} (torch {_torch_version()})")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        add_command(sub, command)
    return parser
