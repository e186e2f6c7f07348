"""`k3 lab`: the article's claims as experiments (`k3.lab`), their tables and plots in DOCS/results.md."""

from __future__ import annotations

import argparse

NAME = "lab"
PARSER = {
    "help": "the article's claims as experiments: tables and plots in runs/lab/results.md"
}  # the keywords of its subparser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`k3 lab`'s arguments, added to its `parser` (made with `PARSER`'s keywords)."""
    parser.add_argument(
        "name", help="an experiment (recall, overwrite, prefill, decode, parts, inspect, lineage) or 'all'"
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the default: all experiments in about 40 minutes")
    size.add_argument("--full", action="store_true", help="the larger sweeps")
    size.add_argument("--smoke", action="store_true", help="seconds per experiment: checks that it runs")
    parser.add_argument(
        "--docs",
        default="runs/lab",
        help="where results.md, lab/*.json and figures/ go (default "
        "runs/lab; --docs docs regenerates the repository's docs/results.md)",
    )
    parser.add_argument("--checkpoint", help="k3 lab inspect: a checkpoint folder (default: train one briefly)")


def run(args) -> int:
    """`k3 lab NAME`: the experiment (or every one, `all`), its claims' verdicts said as each ends; --docs and
    --checkpoint checked before any runs."""
    from .. import lab
    from .preflight import check_checkpoint, check_docs_folder

    mode = "full" if args.full else "smoke" if args.smoke else "quick"
    options = {"checkpoint": args.checkpoint} if args.checkpoint else {}
    if options and args.name != "inspect":
        raise ValueError(f"--checkpoint is for `k3 lab inspect`, not `k3 lab {args.name}`")
    if options:
        check_checkpoint(args.checkpoint, f"--checkpoint {args.checkpoint}")
    check_docs_folder(args.docs)
    names = list(lab.EXPERIMENTS) if args.name == "all" else [args.name]
    for name in names:
        if name in lab.EXPERIMENTS:
            print(f"k3 lab {name} ({mode}): {lab.EXPERIMENTS[name][1]}", flush=True)
        result = lab.run(name, mode, args.docs, **options)
        print(
            f"  {sum(c.verdict == 'holds' for c in result.claims)} of {len(result.claims)} claims hold; "
            f"{result.seconds / 60:.1f} min; {len(result.figures)} figures",
            flush=True,
        )
    print(f"wrote {args.docs}/results.md")
    return 0
