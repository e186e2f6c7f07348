"""The `k3` command line: `k3 train`, `k3 generate`, `k3 export`, `k3 params`, `k3 bench ops|train|models`,
`k3 plan`, `k3 lab`, `k3 eval`.

A failure the user can cause ends in one line, `k3 <command>: error: ...` (the value, what was expected,
what to do), and exit code 2: a flag out of range (checked as it is parsed), a ValueError or OSError
raised for bad input (a setting, a file that is missing, damaged or too big for memory), argparse's
own errors. Ctrl-C ends with exit code 130 (`k3 generate` keeps what it printed, and in its interactive
mode stops only the generation under way; `k3 train` saves a checkpoint first). Any other exception is a
bug and keeps its traceback.
"""

from __future__ import annotations

import sys

from .parser import build_parser

__all__ = ["build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    from ..runtime import exit_with_launcher, keep_freed_memory

    parser = build_parser()
    try:
        args, rest = parser.parse_known_args(argv)
        if args.command != "eval" and rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
    except SystemExit as e:  # argparse's errors (2, already printed) and --help (0)
        return e.code if isinstance(e.code, int) else 2
    if args.command == "eval":
        args.lm_eval_args = rest
    exit_with_launcher()  # a torchrun worker ends with its launcher
    try:
        keep_freed_memory()  # K3_KEEP_FREED_MEMORY that is no switch: a one-line error below
        from ..ops.kernels import check_environment

        check_environment()  # K3_KERNELS, before any command's work
        if args.command == "bench" and getattr(args, "json", None):  # a user's file is never replaced by figures
            from ..bench.timing import check_report_target

            check_report_target(args.json)
        return args.func(args)
    # bad input (and a training run whose loss went non-finite): say what is wrong, no traceback
    except (ValueError, OSError, FloatingPointError) as e:
        print(f"k3 {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nk3 {args.command}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
