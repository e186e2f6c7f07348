"""`k3 eval`: lm-evaluation-harness with the k3 model (`k3.eval.lm_eval`). Its parser takes no arguments of
its own, not even --help: `k3.cli.main` passes everything after `k3 eval` on to lm-eval's command line, as
`args.lm_eval_args`."""

from __future__ import annotations

import argparse

NAME = "eval"
PARSER = {
    "add_help": False,
    "help": "lm-evaluation-harness with the k3 model: k3 eval "
    "--model_args checkpoint=DIR --tasks TASK ... (lm_eval's options)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`k3 eval` adds no arguments (and its `PARSER` no --help): lm-eval's own command line reads them."""


def run(args) -> int:
    """`k3 eval`: lm-eval's own command line, run on `args.lm_eval_args`; its exit code."""
    try:
        from ..eval.lm_eval import main as lm_eval_main
    except ModuleNotFoundError as e:
        if e.name is None or not e.name.startswith("lm_eval"):
            raise
        raise ValueError("lm-evaluation-harness is not installed; pip install 'k3[eval]' (or lm-eval)") from e
    return lm_eval_main(args.lm_eval_args)
