"""`k3 bench llama`: k3 beside llama.cpp on the same weights (`k3.bench.llama`)."""

from __future__ import annotations

import argparse

from ..argtypes import THREADS, count
from ..common import use_threads

NAME = "llama"
PARSER = {
    "help": "k3 (eager, compiled) beside llama.cpp (f32, q8_0) on the same weights: prefill and decode"
}  # the keywords of its subparser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`k3 bench llama`'s checked arguments, added to its `parser` (made with `PARSER`'s keywords)."""
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    parser.add_argument(
        "--models", nargs="+", metavar="NAME", help="a subset of: kimi-k3-tiny kimi-linear-tiny gpt2-tiny kimi-k3-100m"
    )
    parser.add_argument("--contexts", type=count(1, "tokens"), nargs="+", help="decode contexts (default 256 4096)")
    parser.add_argument("--steps", type=count(1, "decode steps"), help="timed decode steps (default 24; quick 12)")
    parser.add_argument("--threads", type=THREADS, help="torch's and llama.cpp's (default: all cores)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")


def run(args) -> int:
    from ...bench import llama

    use_threads(args)
    try:
        llama.run(args.quick, args.models, args.contexts, args.steps, args.threads, args.json)
    except ModuleNotFoundError as e:
        if e.name != "llama_cpp":
            raise
        raise ValueError(str(e)) from e
    return 0
