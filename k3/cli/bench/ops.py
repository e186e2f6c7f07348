"""`k3 bench ops`: the recurrent and chunkwise mixers and causal SDPA timed side by side (`k3.bench.ops`)."""

from __future__ import annotations

import argparse

from ..argtypes import count

NAME = "ops"
PARSER = {"help": "recurrent vs chunk mixers vs causal SDPA"}  # the keywords of its subparser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`k3 bench ops`'s checked arguments, added to its `parser` (made with `PARSER`'s keywords)."""
    parser.add_argument("--quick", action="store_true", help="T in {512, 2048, 8192}, C in {32, 64}: about two minutes")
    parser.add_argument("--T", type=count(1, "tokens"), nargs="+", default=[512, 2048, 8192], help="sequence lengths")
    parser.add_argument(
        "--chunk-sizes", type=count(1, "tokens a chunk"), nargs="+", default=[16, 32, 64, 128], help="chunk sizes C"
    )
    parser.add_argument("--heads", type=count(1, "heads"), default=8, help="heads H")
    parser.add_argument("--dim", type=count(1, "a head dimension"), default=64, help="head dim K = V")
    parser.add_argument(
        "--repeats", type=count(1, "timed runs"), default=3, help="timed runs per case (the best is kept)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")


def run(args) -> int:
    from ...bench import ops

    if args.quick:
        lengths, chunk_sizes, repeats = (512, 2048, 8192), (32, 64), 2
    else:
        lengths, chunk_sizes, repeats = tuple(args.T), tuple(args.chunk_sizes), args.repeats
    ops.run(
        lengths=lengths, chunk_sizes=chunk_sizes, heads=args.heads, dim=args.dim, repeats=repeats, json_path=args.json
    )
    return 0
