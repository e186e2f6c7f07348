"""`k3 params`: parameter count, active parameters and decode memory of a preset, a checkpoint folder or a
config.json (`k3.models.params` computes them), as a table or as JSON, optionally beside a second model.

A model is named by what it is: a preset by its name, a k3 checkpoint by the name its run recorded (the
preset it was built from), a Kimi config.json by its `_name_or_path` or else its family (`model_type`:
"kimi-k3", "kimi-linear"). A family name is also a preset's, the published model's: a Kimi config.json of
another size (`k3 export RUN OUT --format kimi-k3` of a tiny run) is named after its folder instead.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

NAME = "params"
PARSER = {"help": "parameter count, active parameters and decode memory of a preset"}  # the keywords of its subparser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`k3 params`'s arguments, added to its `parser` (made with `PARSER`'s keywords)."""
    parser.add_argument(
        "preset",
        nargs="?",
        metavar="PRESET|DIR",
        help="a preset name, a checkpoint directory or a config.json (omit to list the presets)",
    )
    parser.add_argument(
        "--vs", metavar="PRESET|DIR", help="also print the ratio of total parameters to this preset or checkpoint"
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON (both models' with --vs)")


def named_config(source: str):
    """`config_for(source)` (a ModelConfig) under a name that says what it is (module docstring)."""
    from ..io import read_json
    from ..models import PRESETS, get_config
    from ..models.params import config_for

    config = config_for(source)
    if source in PRESETS or config.name not in PRESETS:
        return config
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if "k3" in read_json(path) or config == get_config(config.name):
        return config  # the name its run recorded, or the published model itself
    folder = path.resolve().parent.name
    return config.replace(name=f"{folder} ({config.name} architecture, not the {config.name} preset)")


def figures(source: str, config) -> dict:
    """`k3 params --json`'s figures of one model: what was asked for, its name, the counts."""
    import dataclasses

    from ..models.params import count_params

    return {"preset": source, "name": config.name, **dataclasses.asdict(count_params(config))}


def run(args: argparse.Namespace) -> int:
    """`k3 params`: the presets, or one model's figures (beside a second's with --vs), as a table or JSON."""
    from ..models import PRESETS
    from ..models.params import format_report

    if args.preset is None:
        if args.vs:
            raise ValueError(f"--vs {args.vs}: compares with a model given first (k3 params PRESET|DIR --vs ...)")
        print(json.dumps({"presets": list(PRESETS)}, indent=2) if args.json else "presets: " + ", ".join(PRESETS))
        return 0
    config = named_config(args.preset)
    vs = named_config(args.vs) if args.vs else None
    if not args.json:
        print(format_report(config, vs))
        return 0
    out = figures(args.preset, config)
    if vs is not None:
        other = figures(args.vs, vs)
        out.update(vs=other, ratio=out["total"] / other["total"])
    print(json.dumps(out, indent=2))
    return 0
