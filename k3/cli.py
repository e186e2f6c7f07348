"""The `k3` command line: `k3 params`, `k3 bench ops` (more subcommands arrive with training and generation)."""

from __future__ import annotations

import argparse
import sys


def _bench_ops(args) -> int:
    from .bench import ops

    if args.quick:
        lengths, chunk_sizes, repeats = (512, 2048), (32, 64), 2
    else:
        lengths, chunk_sizes, repeats = tuple(args.T), tuple(args.chunk_sizes), args.repeats
    ops.run(lengths=lengths, chunk_sizes=chunk_sizes, heads=args.heads, dim=args.dim, repeats=repeats,
            json_path=args.json)
    return 0


def _params(args) -> int:
    from .models import PRESETS, get_config
    from .models.params import count_params, format_report

    if args.preset is None:
        print("presets: " + ", ".join(PRESETS))
        return 0
    config = get_config(args.preset)
    vs = get_config(args.vs) if args.vs else None
    if args.json:
        import dataclasses
        import json

        print(json.dumps({"preset": args.preset, **dataclasses.asdict(count_params(config))}, indent=2))
    else:
        print(format_report(config, vs))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k3", description="Kimi K3 and its lineage in PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    params = sub.add_parser("params", help="parameter count, active parameters and decode memory of a preset")
    params.add_argument("preset", nargs="?", help="a preset name (omit to list them)")
    params.add_argument("--vs", metavar="PRESET", help="also print the ratio of total parameters to this preset")
    params.add_argument("--json", action="store_true", help="print the figures as JSON")
    params.set_defaults(func=_params)
    bench = sub.add_parser("bench", help="benchmarks (ratios measured side by side in one run)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    ops = bench_sub.add_parser("ops", help="recurrent vs chunk mixers vs causal SDPA")
    ops.add_argument("--quick", action="store_true", help="T in {512, 2048}, C in {32, 64}: about a minute")
    ops.add_argument("--T", type=int, nargs="+", default=[512, 2048, 8192], help="sequence lengths")
    ops.add_argument("--chunk-sizes", type=int, nargs="+", default=[16, 32, 64, 128])
    ops.add_argument("--heads", type=int, default=8)
    ops.add_argument("--dim", type=int, default=64, help="head dim K = V")
    ops.add_argument("--repeats", type=int, default=3, help="timed runs per case (the best is kept)")
    ops.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    ops.set_defaults(func=_bench_ops)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .runtime import keep_freed_memory

    args = build_parser().parse_args(argv)
    keep_freed_memory()
    try:
        return args.func(args)
    except ValueError as e:  # bad input: say what is wrong, no traceback
        print(f"k3 {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
