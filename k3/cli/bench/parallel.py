"""`k3 bench parallel`: what each process of fsdp x ep sends and holds, on gloo processes
(`k3.bench.parallel`; --saves: `k3.bench.saves`)."""

from __future__ import annotations

import argparse

from ..argtypes import count

NAME = "parallel"
PARSER = {
    "help": "bytes each process of fsdp x ep sends in a step and its peak "
    "memory, measured on gloo processes beside k3 plan's model"
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`k3 bench parallel`'s checked arguments, added to its `parser` (made with `PARSER`'s keywords)."""
    parser.add_argument(
        "--layouts",
        nargs="+",
        default=["2:1", "2:2", "4:2"],
        metavar="N:EP",
        help="process counts and ep, each N:EP (default 2:1 2:2 4:2)",
    )
    parser.add_argument("--preset", default="kimi-k3-tiny", help="the model (default kimi-k3-tiny)")
    parser.add_argument(
        "--seq-len", type=count(1, "tokens a sequence"), default=256, help="tokens a sequence (default 256)"
    )
    parser.add_argument(
        "--batch-size", type=count(1, "sequences"), default=8, help="sequences a step, over all processes (8)"
    )
    parser.add_argument(
        "--precision",
        nargs="+",
        choices=("fp32", "bf16"),
        default=["fp32", "bf16"],
        help="k3 train's --precision of the jobs: fp32 with recompute none and full, bf16 with none (default both)",
    )
    parser.add_argument(
        "--saves",
        action="store_true",
        help="instead: the step time around a checkpoint, synchronous against --async-checkpoint "
        "(2 processes, --preset, --seq-len, --batch-size)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")


def run(args) -> int:
    from ...bench import parallel, saves
    from ...models import PRESETS

    if args.preset not in PRESETS:  # before any process is spawned
        raise ValueError(f"--preset {args.preset!r} is no preset; the presets are: {', '.join(PRESETS)}")
    if args.saves:  # the step time around a save, sync against async
        saves.run(2, args.preset, seq_len=args.seq_len, batch_size=args.batch_size, json_path=args.json)
        return 0
    layouts = []
    for text in args.layouts:
        try:
            world, ep = (int(part) for part in text.split(":"))
        except ValueError:
            raise ValueError(f"--layouts takes N:EP pairs (processes : ep), e.g. 4:2, got {text!r}") from None
        if world < 1 or ep < 1 or world % ep or args.batch_size % world:
            raise ValueError(f"--layouts {text}: ep must divide {world}, {world} divide --batch-size {args.batch_size}")
        layouts.append((world, ep))
    parallel.run(tuple(layouts), args.preset, args.seq_len, args.batch_size, args.json, tuple(args.precision))
    return 0
