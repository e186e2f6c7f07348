"""`k3 bench train`: kimi-k3-tiny against a GPT-2 of equal width and parameters, trained alike (`k3.bench.train`)."""

from __future__ import annotations

import argparse

from ..argtypes import number

NAME = "train"


def add_parser(subparsers) -> argparse.ArgumentParser:
    """`k3 bench train`'s parser and its checked arguments, added to `subparsers` (`k3 bench`'s)."""
    parser = subparsers.add_parser(NAME, help="kimi-k3-tiny vs a GPT-2 of equal width and parameters")
    parser.add_argument(
        "--minutes", type=number(0, "minutes", above=True), default=5.0, help="training budget of each model"
    )
    parser.add_argument("--data", help="corpus (default: Shakespeare)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    return parser


def run(args) -> int:
    from ...bench import train

    train.run(minutes=args.minutes, json_path=args.json, data=args.data)
    return 0
