"""`k3 bench backward`: the delta family's own chunkwise backward against autograd through the forward
(`k3.bench.backward`)."""

from __future__ import annotations

import argparse

from ..argtypes import THREADS, count
from ..common import use_threads

NAME = "backward"
PARSER = {
    "help": "the delta family's own chunkwise backward vs autograd through the forward: time and peak memory"
}  # the keywords of its subparser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`k3 bench backward`'s checked arguments, added to its `parser` (made with `PARSER`'s keywords)."""
    parser.add_argument("--quick", action="store_true", help="KDA only, fewer rounds: under a minute")
    parser.add_argument("--threads", type=THREADS, help="torch threads (default: all cores)")
    parser.add_argument(
        "--rounds", type=count(1, "timing rounds"), default=15, help="interleaved timing rounds (default 15)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")


def run(args) -> int:
    from ...bench import backward

    use_threads(args)
    if args.quick:
        backward.run(ops=("kda",), rounds=5, json_path=args.json)
    else:
        backward.run(rounds=args.rounds, json_path=args.json)
    return 0
