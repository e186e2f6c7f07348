"""`k3 bench profile`: one training step, part by part (`k3.bench.profile`)."""

from __future__ import annotations

import argparse

from ..argtypes import THREADS, count
from ..common import use_threads

NAME = "profile"
PARSER = {
    "help": "one training step of kimi-k3-tiny and its matched GPT-2, "
    "part by part: forward and backward ms of every layer's parts"
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`k3 bench profile`'s checked arguments, added to its `parser` (made with `PARSER`'s keywords)."""
    parser.add_argument(
        "--rounds", type=count(1, "timing rounds"), default=5, help="interleaved timing rounds (default 5)"
    )
    parser.add_argument("--threads", type=THREADS, help="torch threads (default: all cores)")
    parser.add_argument("--data", help="corpus (default: Shakespeare)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")


def run(args) -> int:
    from ...bench import profile

    use_threads(args)
    profile.run(rounds=args.rounds, json_path=args.json, data=args.data)
    return 0
