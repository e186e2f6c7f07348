"""`k3 plan PRESET|CONFIG_DIR [--train | --serve] [--json]`: the arguments and what they run."""

from __future__ import annotations

import argparse

from .hardware import GPUS

MAX_RANKS = 1 << 20  # GPUs, ranks or stages: past a million GPUs no cluster has been built to plan for
MAX_TOKENS = 1 << 40  # tokens of a sequence, a context or a step


def _positive(what: str, high: int):
    """An argparse type: an integer in [1, high]; `what` says what it counts."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if not 1 <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {what}, an integer in [1, {high:,}], got {text!r}")
        return value

    return parse


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a model FLOP utilisation in (0, 1], got {text!r}")
    return value


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        metavar="PRESET|CONFIG_DIR",
        help="a preset (k3 params lists them) or a directory with a config.json",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--train", action="store_true", help="a training plan (the default)")
    mode.add_argument("--serve", action="store_true", help="a serving plan")
    mode.add_argument(
        "--published",
        action="store_true",
        help="the planner against published figures (DeepSeek-V3, Kimi K3's repository, nanoGPT)",
    )
    parser.add_argument("--json", action="store_true", help="every figure with its unit, as JSON")
    parser.add_argument("--gpu", choices=tuple(GPUS), help="GPU type (default h200)")
    parser.add_argument(
        "--gpus",
        type=_positive("GPUs", MAX_RANKS),
        help="training: GPUs in all (default 8); serving: GPUs per replica (default: the fewest whole "
        "nodes that hold the weights)",
    )
    train = parser.add_argument_group("training")
    train.add_argument(
        "--fsdp", type=_positive("FSDP ranks", MAX_RANKS), help="FSDP ranks per pipeline stage (default: gpus / pp)"
    )
    train.add_argument(
        "--ep",
        type=_positive("expert-parallel ranks", MAX_RANKS),
        help="expert-parallel ranks (default: the largest up to 64 that divides the experts and --fsdp)",
    )
    train.add_argument("--pp", type=_positive("pipeline stages", MAX_RANKS), help="pipeline stages (default 1)")
    train.add_argument(
        "--seq-len",
        type=_positive("tokens per sequence", MAX_TOKENS),
        help="tokens per training sequence (default 4096)",
    )
    train.add_argument(
        "--micro-batch",
        type=_positive("sequences", MAX_TOKENS),
        help="sequences per micro-batch (default 1)",
    )
    train.add_argument(
        "--global-batch-tokens",
        type=_positive("tokens", MAX_TOKENS),
        help="tokens per optimizer step (default: one micro-batch per rank)",
    )
    train.add_argument(
        "--optimizer",
        choices=("muon", "adamw"),
        help="whose states the memory plan counts: muon (k3 train's default; one momentum a "
        "matrix, AdamW's two moments on the rest) or adamw (default muon)",
    )
    train.add_argument("--precision", choices=("bf16", "fp8"), help="whose dense peak the MFU is of (default bf16)")
    train.add_argument("--mfu", type=_fraction, help="assumed model FLOP utilisation (default 0.40)")
    train.add_argument(
        "--recompute",
        choices=("none", "selective", "full"),
        help="activation recomputation (default: the least that fits)",
    )
    serve = parser.add_argument_group("serving")
    serve.add_argument(
        "--context",
        type=_positive("tokens", MAX_TOKENS),
        help="tokens per sequence (default 1,048,576)",
    )
    serve.add_argument(
        "--experts",
        choices=("bf16", "mxfp4"),
        help="routed experts' format (default mxfp4, as Kimi K3 is published)",
    )
    serve.add_argument(
        "--concurrent",
        type=_positive("sequences", MAX_TOKENS),
        help="sequences decoded together (default: as many as fit)",
    )


def load_config(name: str):
    """A preset by name, or the config.json of a directory (a k3 checkpoint or a Kimi config)."""
    from pathlib import Path

    from ..models import PRESETS, ModelConfig, get_config

    if name in PRESETS:
        return get_config(name)
    path = Path(name)
    if path.is_dir():
        from ..checkpoints.checkpoint import read_config

        return read_config(path, ModelConfig)[0]
    raise ValueError(f"{name!r} is neither a preset ({', '.join(PRESETS)}) nor a directory with a config.json")


# each mode's own flags (argparse dest: the flag) and what a flag left out means
TRAIN_FLAGS = dict(
    fsdp=None,
    ep=None,
    pp=None,
    seq_len=4096,
    micro_batch=1,
    global_batch_tokens=None,
    optimizer="muon",
    precision="bf16",
    mfu=0.40,
    recompute=None,
)
SERVE_FLAGS = dict(context=1 << 20, experts="mxfp4", concurrent=None)
SHARED_FLAGS = dict(gpu="h200", gpus=None)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _refuse_flags_of_other_modes(args, mode: str, own: dict) -> None:
    """A flag the chosen mode does not read (--context for a training plan, --fsdp for a serving one, any for
    --published) would be silently ignored: refused, naming it and the mode that reads it."""
    for other, flags in (("--train", TRAIN_FLAGS), ("--serve", SERVE_FLAGS), ("--train or --serve", SHARED_FLAGS)):
        given = [_flag(dest) for dest in flags if dest not in own and getattr(args, dest) is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: a flag of {other} plans, not of {mode} (k3 plan --help)")


def _with_defaults(args, flags: dict) -> dict:
    return {dest: default if getattr(args, dest) is None else getattr(args, dest) for dest, default in flags.items()}


def run_plan(args) -> list:
    """The Figures `k3 plan` prints for `args`."""
    if args.published:
        _refuse_flags_of_other_modes(args, "--published", {})
        if args.model is not None:
            raise ValueError(
                f"--published checks the planner against published models; give no model (got {args.model!r})"
            )
        from .published import CHECKS

        return [check() for check in CHECKS.values()]
    if args.model is None:
        raise ValueError("give a preset or a config directory (or --published)")
    mode = "--serve" if args.serve else "--train"
    _refuse_flags_of_other_modes(args, mode, {**SHARED_FLAGS, **(SERVE_FLAGS if args.serve else TRAIN_FLAGS)})
    config = load_config(args.model)
    args = argparse.Namespace(**{**vars(args), **_with_defaults(args, {**SHARED_FLAGS, **SERVE_FLAGS, **TRAIN_FLAGS})})
    if args.serve:
        from .serving import ServeSettings, plan_serving

        return [
            plan_serving(
                config,
                ServeSettings(
                    gpu=args.gpu, gpus=args.gpus, context=args.context, experts=args.experts, concurrent=args.concurrent
                ),
            )
        ]
    from .training import TrainSettings, plan_training

    return [
        plan_training(
            config,
            TrainSettings(
                gpus=args.gpus or 8,
                gpu=args.gpu,
                pp=args.pp,
                fsdp=args.fsdp,
                ep=args.ep,
                seq_len=args.seq_len,
                global_batch_tokens=args.global_batch_tokens,
                micro_batch=args.micro_batch,
                optimizer=args.optimizer,
                precision=args.precision,
                mfu=args.mfu,
                recompute=args.recompute,
            ),
        )
    ]
