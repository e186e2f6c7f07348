"""`k3 bench models`: whole-model prefill, train step and decode speed (`k3.bench.models`; --compile:
`k3.bench.compiled`)."""

from __future__ import annotations

import argparse

from ..argtypes import THREADS, count
from ..common import use_threads

NAME = "models"
PARSER = {
    "help": "whole-model prefill, train step and decode speed, k3 vs GPT-2 and transformers"
}  # the keywords of its subparser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`k3 bench models`'s checked arguments, added to its `parser` (made with `PARSER`'s keywords)."""
    parser.add_argument(
        "--quick", action="store_true", help="fewer rounds and steps, a smaller train step: about a minute"
    )
    parser.add_argument("--threads", type=THREADS, help="torch threads (default: all cores)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument(
        "--models",
        nargs="+",
        metavar="NAME",
        help="a subset of: kimi-k3-tiny kimi-linear-tiny "
        "gpt2-tiny transformers-gpt2 transformers-kimi-linear (default: all)",
    )
    parser.add_argument("--contexts", type=count(1, "tokens"), nargs="+", help="decode contexts (default 256 4096)")
    parser.add_argument("--prefill", type=count(1, "tokens"), help="prefill tokens (default 2048)")
    parser.add_argument(
        "--train",
        type=count(1, "a size"),
        nargs=2,
        metavar=("B", "T"),
        help="train step shape (default 16 256; quick 8 256)",
    )
    parser.add_argument(
        "--batch", type=count(1, "sequences"), nargs=2, metavar=("B1", "B2"), help="decode batches compared (1 8)"
    )
    parser.add_argument(
        "--rounds", type=count(1, "rounds"), help="interleaved rounds of prefill and train step (default 3; quick 2)"
    )
    parser.add_argument(
        "--steps",
        type=count(1, "decode steps"),
        help="timed decode steps per model and context (default 24; quick 16)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="instead: eager and compiled decode ms/token (static cache, inductor) of kimi-k3-tiny, "
        "kimi-linear-tiny and the matched GPT-2 at each context and batch, and the compile times "
        "(first, cached) in fresh processes; needs a C++ compiler",
    )


def run(args) -> int:
    from ...bench import models

    use_threads(args)
    if args.compile:
        from ...bench import compiled

        compiled.run(
            quick=args.quick,
            contexts=args.contexts,
            batch=args.batch,
            steps=args.steps,
            n_threads=args.threads,
            json_path=args.json,
        )
        return 0
    models.run(
        quick=args.quick,
        contexts=args.contexts,
        prefill=args.prefill,
        train=args.train,
        batch=args.batch,
        rounds=args.rounds,
        steps=args.steps,
        models=args.models or models.MODELS,
        n_threads=args.threads,
        json_path=args.json,
    )
    return 0
