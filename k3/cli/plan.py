"""`k3 plan`: what training or serving a model takes at cluster scale, on paper; its arguments and the plans
are `k3.plan.commands`', this module prints them."""

from __future__ import annotations

import argparse

NAME = "plan"
PARSER = {"help": "what training or serving a model takes at cluster scale, on paper"}  # the keywords of its subparser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`k3 plan`'s arguments (`k3.plan.commands.add_plan_arguments`'), added to its `parser`."""
    from ..plan.commands import add_plan_arguments

    add_plan_arguments(parser)


def run(args) -> int:
    """`k3 plan`: the plans, as text or (--json) one JSON object, or a list of them."""
    import json

    from ..plan.commands import run_plan

    plans = run_plan(args)
    if args.json:
        print(json.dumps([f.to_json() for f in plans] if len(plans) > 1 else plans[0].to_json(), indent=2))
    else:
        print("\n\n".join(f.format() for f in plans))
    return 0
