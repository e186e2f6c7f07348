"""The `k3` command line's checked argument types (`count`, `number`, `SEED`, `THREADS`: argparse types
that refuse a bad value in one line, naming what was expected) and its argparse parser class (`Parser`),
which puts every default in `--help`: what every command module of k3.cli builds its arguments with."""

from __future__ import annotations

import argparse
import math

from ..inference.generation import MAX_SEED
from ..training.config import max_threads, threads_bound_words


class DefaultsFormatter(argparse.HelpFormatter):
    """`--help` shows each option's default, "(default: X)", unless the help already says it or there is
    none to show (a flag that is off, an option whose default is "not given")."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        default = " ".join(map(str, action.default)) if isinstance(action.default, (list, tuple)) else "%(default)s"
        return f"{text} (default: {default})" if text else f"default: {default}"


class Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (the usage of `k3 train` alone takes a dozen) and every
    default in `--help`."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def count(low: int, what: str, high: int | None = None):
    """An argparse type: an integer >= low (and <= high, when given); `what` says what it counts."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low or (high is not None and value > high):
            bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"expected {what}, an integer {bounds}, got {text!r}")
        return value

    return parse


SEED = count(0, "a seed", high=MAX_SEED)


def THREADS(text: str) -> int:
    """An argparse type: torch threads, in [1, max_threads()] (k3.training.config: far past the cores torch's and
    the tokenizers' thread pools crash)."""
    high = max_threads()
    try:
        return count(1, "torch threads", high=high)(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e} ({threads_bound_words()})") from None


def number(low: float, what: str, above: bool = False, high: float = math.inf):
    """An argparse type: a finite number >= low (> low when `above`) and <= high."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and (value > low if above else value >= low) and value <= high):
            bounds = f"{'>' if above else '>='} {low:g}" + (f" and <= {high:g}" if high < math.inf else "")
            raise argparse.ArgumentTypeError(f"expected {what}, a finite number {bounds}, got {text!r}")
        return value

    return parse
