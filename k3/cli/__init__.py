"""The `k3` command line: `k3 train`, `k3 generate`, `k3 serve`, `k3 export`, `k3 params`, `k3 plan`, `k3 bench
ops|train|models|...`, `k3 lab`, `k3 eval`. Each command is one module of this package (`k3 bench`'s
subcommands: one each in k3/cli/bench/) with the same interface (`k3.cli.common.Command`): `NAME`,
`PARSER` (its subparser's keywords), `add_arguments(parser)` and `run(args)` (vLLM's CLISubcommand);
`k3.cli.parser.build_parser` makes the whole parser of them.

A failure the user can cause ends in one line, `k3 <command>: error: ...` (the value, what was expected,
what to do), and exit code 2: a flag out of range (checked as it is parsed), a ValueError or OSError
raised for bad input (a setting, a file that is missing, damaged or too big for memory), argparse's
own errors (an unknown flag named by the subcommand it was given to). Ctrl-C ends with exit code 130 (`k3
generate` keeps what it printed, and in its interactive mode stops only the generation under way; `k3 train`
saves a checkpoint first, and takes SIGTERM and SIGHUP alike: exit 143, 129), said in one line, also while
torch loads. Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading

__all__ = ["build_parser", "main"]


def __getattr__(name: str):
    if name == "build_parser":  # imported when asked for: main's Ctrl-C covers the imports (torch's seconds)
        from .parser import build_parser

        return build_parser
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: list[str] | None = None) -> int:
    with _ctrl_c_deferred() as pressed:  # while torch and the commands' modules load (seconds)
        try:
            from .parser import build_parser

            parser = build_parser()
            args, rest = parser.parse_known_args(argv)
            if args.command != "eval" and rest:
                _subcommand(parser, args).error(f"unrecognized arguments: {' '.join(rest)}")
        except SystemExit as e:  # argparse's errors (2, already printed) and --help (0)
            return e.code if isinstance(e.code, int) else 2
    if pressed:
        print("\nk3: interrupted (Ctrl-C) while starting; nothing was done", file=sys.stderr)
        return 130
    if args.command == "eval":
        args.lm_eval_args = rest
    return _run(args)


@contextlib.contextmanager
def _ctrl_c_deferred():
    """Ctrl-C only noted (the yielded list gets its signal) inside the block: raised inside `import torch`, a
    KeyboardInterrupt can abort the process from C++ (pybind11's terminate) or be lost."""
    pressed: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield pressed
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)


def _subcommand(parser: argparse.ArgumentParser, args) -> argparse.ArgumentParser:
    """The parser of the (sub)subcommand `args` ran, `k3 bench ops`'s for `k3 bench ops ...`: its errors name
    it and point at its --help."""
    for name in ("command", "bench"):
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not actions or getattr(args, name, None) not in actions[0].choices:
            break
        parser = actions[0].choices[getattr(args, name)]
    return parser


def _run(args) -> int:
    from ..runtime import exit_with_launcher, keep_freed_memory

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
