"""`k3 bench train`: kimi-k3-tiny against a GPT-2 of equal width and parameters, trained alike (`k3.bench.train`)."""

from __future__ import annotations

import argparse

from ..argtypes import number

NAME = "train"
PARSER = {"help": "kimi-k3-tiny vs a GPT-2 of equal width and parameters"}  # the keywords of its subparser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`k3 bench train`'s checked arguments, added to its `parser` (made with `PARSER`'s keywords)."""
    parser.add_argument(
        "--minutes", type=number(0, "minutes", above=True), default=5.0, help="training budget of each model"
    )
    parser.add_argument("--data", help="corpus (default: Shakespeare)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")


def run(args) -> int:
    from ...bench import train

    train.run(minutes=args.minutes, json_path=args.json, data=args.data)
    return 0
