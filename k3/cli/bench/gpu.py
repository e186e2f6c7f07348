"""`k3 bench gpu`: the device check on one CUDA GPU (`k3.bench.gpu`)."""

from __future__ import annotations

import argparse

NAME = "gpu"
PARSER = {
    "help": "the device check on one CUDA GPU: the CUDA tests, fla's kernels behind k3's ops, a ~1B Kimi K3 "
    "training step (tokens/s, MFU), the compiled decode step vs transformers: under 8 minutes"
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`k3 bench gpu`'s checked arguments, added to its `parser` (made with `PARSER`'s keywords)."""
    parser.add_argument("--dry-run", action="store_true", help="print what would run and time; needs no GPU")
    parser.add_argument(
        "--tiny", action="store_true", help="every part at toy sizes, eager, on any device (a smoke test: seconds)"
    )
    parser.add_argument("--device", default="cuda", help="the device (default cuda; --tiny also runs on cpu)")
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=("tests", "ops", "train", "decode"),
        default=["tests", "ops", "train", "decode"],
        help="which parts to run, in the report's order (default all)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")


def run(args) -> int:
    from ...bench import gpu

    settings = gpu.TINY if args.tiny else gpu.Settings()
    if args.dry_run:
        print("\n".join(gpu.describe(settings)))
        return 0
    if args.device != "cpu" and not args.device.startswith("cuda"):
        raise ValueError(f"--device must be cuda (or cpu with --tiny), got {args.device!r}")
    if args.device == "cpu" and not args.tiny:
        raise ValueError("--device cpu runs only with --tiny: the full sizes are for a GPU")
    gpu.run(settings, args.device, args.json, parts=tuple(args.parts))
    return 0
