"""`k3 bench serve`: `k3 serve` under load (`k3.bench.serve`)."""

from __future__ import annotations

import argparse

from ...bench.serve import PARTS
from ..argtypes import THREADS, count, number
from ..common import size_flag, use_threads

NAME = "serve"
PARSER = {
    "help": "k3 serve under load: throughput, latency and concurrent sequences "
    "in one cache budget, kimi-k3-tiny vs kimi-linear-tiny vs the matched GPT-2"
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`k3 bench serve`'s checked arguments, added to its `parser` (made with `PARSER`'s keywords)."""
    parser.add_argument("--quick", action="store_true", help="20 s per load instead of 60 s: about 4 minutes")
    parser.add_argument("--duration", type=number(0, "seconds", above=True), help="seconds per load")
    parser.add_argument("--clients", type=count(1, "concurrent clients"), default=64, help="concurrent clients")
    parser.add_argument(
        "--contexts",
        type=count(2, "tokens"),
        nargs="+",
        default=[256, 4096],
        help="contexts (prompt + output, half each)",
    )
    parser.add_argument("--cache-memory", default="128MiB", metavar="SIZE", help="the servers' cache budget")
    parser.add_argument("--threads", type=THREADS, help="the servers' torch threads")
    parser.add_argument(
        "--soak",
        type=number(0, "seconds", above=True),
        metavar="SECONDS",
        help="instead: one long load on kimi-k3-tiny whose clients disconnect at random; reports "
        "failures and slots left held",
    )
    parser.add_argument(
        "--disconnect",
        type=number(0, "a fraction", high=1),
        help="--soak: the fraction of requests that disconnect mid-stream (default 0.3)",
    )
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=PARTS,
        default=list(PARTS),
        help="which loads: models (the three models, eager), batching (1 and 16 clients), engine (eager vs "
        "compiled steps), poisson (arrivals near saturation, prefill chunked and not), prefix (a shared "
        "system prompt, prefix cache on and off), long (a 16,384-token prompt arriving under load, and the "
        "same load without it)",
    )
    parser.add_argument(
        "--stream-interval",
        type=count(1, "tokens"),
        default=1,
        help="the servers' --stream-interval: a streamed event every N tokens after the first (default 1)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")


def run(args) -> int:
    from ...bench import serve
    from ...serve import require_serve_extra

    require_serve_extra("k3 bench serve")
    if args.disconnect is not None and args.soak is None:
        raise ValueError(f"--disconnect {args.disconnect:g}: a setting of the --soak load; give --soak SECONDS too")
    cache_memory = size_flag(args.cache_memory, "--cache-memory")
    use_threads(args)
    serve.run(
        quick=args.quick,
        duration=args.duration,
        clients=args.clients,
        contexts=tuple(args.contexts),
        cache_memory=cache_memory,
        threads=args.threads,
        soak=args.soak,
        disconnect=0.3 if args.disconnect is None else args.disconnect,
        json_path=args.json,
        parts=tuple(args.parts),
        stream_interval=args.stream_interval,
    )
    return 0
