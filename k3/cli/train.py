"""`k3 train`: its arguments, the TrainConfig they make (`train_config`), and the run (`k3.training.train`)."""

from __future__ import annotations

import argparse
import sys

from ..runtime import DEVICES
from ..training.config import MAX_TIME_BUDGET
from .argtypes import SEED, THREADS, count, number
from .common import use_threads

NAME = "train"
PARSER = {"help": "train a model on a text corpus (default: Shakespeare)"}  # the keywords of its subparser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`k3 train`'s checked arguments, added to its `parser` (made with `PARSER`'s keywords)."""
    parser.add_argument("--preset", default="kimi-k3-tiny", help="model preset (k3 params lists them)")
    parser.add_argument("--hidden-size", type=count(1, "a width"), help="override the preset's width")
    parser.add_argument(
        "--num-layers", type=count(1, "a depth"), help="override the preset's depth (its layer pattern is kept)"
    )
    parser.add_argument(
        "--set",
        action="append",
        metavar="FIELD=VALUE",
        help="override any ModelConfig field, e.g. --set num_experts=8 (repeatable)",
    )
    parser.add_argument("--data", help="a UTF-8 text file or folder (default: Shakespeare's works, fetched once)")
    parser.add_argument(
        "--tokenizer",
        choices=("bpe", "byte"),
        default="bpe",
        help="byte-level BPE trained on the corpus, or the 256 bytes themselves",
    )
    parser.add_argument(
        "--vocab-size",
        type=count(257, "BPE entries (256 bytes + <|endoftext|> + merges)"),
        default=4096,
        help="BPE vocabulary size",
    )
    parser.add_argument("--seq-len", type=count(1, "tokens per sequence"), default=256, help="tokens per sequence")
    parser.add_argument(
        "--batch-size",
        type=count(1, "sequences per step"),
        default=8,
        help="sequences per step, or per micro-batch with --grad-accum (default 8: in a fixed time "
        "budget, more smaller steps learn more)",
    )
    parser.add_argument(
        "--grad-accum",
        type=count(1, "micro-batches per optimizer step"),
        metavar="N",
        help="N micro-batches of --batch-size per optimizer step (default 1): the step of an N "
        "times larger batch, in the memory of one micro-batch",
    )
    parser.add_argument(
        "--optimizer",
        choices=("muon", "adamw"),
        help="muon (the default, as Kimi trains): Muon on the hidden matrices, AdamW on the "
        "embeddings, head and vectors, one learning rate for both; or adamw on everything",
    )
    parser.add_argument(
        "--lr",
        type=number(0, "a learning rate", above=True),
        default=3e-3,
        help="peak learning rate (Muon's and AdamW's)",
    )
    parser.add_argument(
        "--warmup",
        type=count(0, "warmup steps"),
        help="linear warm-up steps (default: 5%% of the run's steps, at most 50)",
    )
    parser.add_argument(
        "--schedule",
        choices=("cosine", "wsd"),
        default="wsd",
        help="after the warmup: constant then a linear decay over the last 20%% (wsd, the default: "
        "a time budget re-planned on the way changes nothing before the decay), or cosine",
    )
    parser.add_argument(
        "--weight-decay",
        type=number(0, "a weight decay"),
        default=0.1,
        help="decoupled weight decay of the matrices (norms, biases and gate parameters: none)",
    )
    parser.add_argument(
        "--grad-clip",
        type=number(0, "a gradient norm", above=True),
        default=1.0,
        help="clip the gradient norm to this",
    )
    parser.add_argument(
        "--qk-clip",
        type=number(0, "a logit bound (0: off)"),
        metavar="TAU",
        help="QK-Clip (MuonClip's): after each step, scale down the query and key weights of every "
        "attention head whose largest logit went above TAU, to TAU (default 100 with Muon, off "
        "with adamw; 0 turns it off)",
    )
    parser.add_argument(
        "--max-steps",
        type=count(1, "training steps"),
        help="training steps (default 1000 unless --time-budget; not with --time-budget)",
    )
    parser.add_argument(
        "--time-budget",
        type=number(0, "minutes", above=True, high=MAX_TIME_BUDGET),
        metavar="MIN",
        help="train for about this many minutes (the step count planned from the steps' speed; not with --max-steps)",
    )
    parser.add_argument(
        "--eval-every",
        type=count(1, "steps between evaluations"),
        default=100,
        help="evaluate on the validation split every N steps",
    )
    parser.add_argument(
        "--eval-tokens",
        type=count(1, "validation tokens"),
        default=32768,
        help="validation tokens per periodic evaluation (default 32768)",
    )
    parser.add_argument(
        "--final-eval-tokens",
        type=count(0, "validation tokens (0: no final evaluation)"),
        metavar="N",
        help="validation tokens of the final evaluation (default 262144; 0 skips it)",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=count(1, "steps between checkpoints"),
        help="also save every N steps (default: at the end only)",
    )
    parser.add_argument(
        "--async-checkpoint",
        action="store_true",
        help="--parallel fsdp | ep: a save copies the state to CPU memory and the next step starts while a "
        "thread writes the files (torch.distributed.checkpoint.async_save); still committed all-or-nothing, "
        "and finished before the next save and the end of training",
    )
    parser.add_argument("--out", default="runs/k3", help="checkpoint directory (and the run's metrics.jsonl)")
    parser.add_argument("--resume", metavar="DIR", help="continue the run saved in DIR")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the k3 checkpoint already in --out with this new run (without it, a new run "
        "refuses such a folder; files k3 did not write are never replaced)",
    )
    parser.add_argument("--seed", type=SEED, default=0, help="seed of the initial weights and the data order")
    parser.add_argument(
        "--threads",
        type=THREADS,
        help="torch threads (default: all cores); 1 is often faster on a machine busy with other "
        "work, where threads wait for each other",
    )
    parser.add_argument(
        "--device",
        choices=DEVICES,
        help="where to train: auto (the default) picks CUDA, then Apple's MPS, then the CPU",
    )
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        help="bf16: the forward passes under bfloat16 autocast, float32 weights and optimizer states, "
        "float32 states in the linear-attention ops (default fp32)",
    )
    parser.add_argument(
        "--log",
        choices=("tensorboard", "wandb", "none"),
        help="also send OUT/metrics.jsonl's figures to TensorBoard (OUT/tensorboard) or wandb "
        "(needs the package; default none)",
    )
    parser.add_argument(
        "--ep",
        type=count(1, "ranks of an expert-parallel group"),
        metavar="N",
        help="with --parallel fsdp: split every MoE layer's experts over groups of N processes, each "
        "expert sharded over the processes that hold it (default 1: fsdp alone)",
    )
    parser.add_argument(
        "--recompute",
        choices=("none", "full", "selective"),
        help="activation recompute: full keeps only each decoder layer's inputs and runs its "
        "forward again in the backward pass; selective does so on every 2nd layer (default none)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the decoder: ~0.8x the step time after ~2.5 min of compiling (CPU, "
        "kimi-k3-tiny); worth it for long runs, not the 13-minute demo; needs a C++ compiler",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--parallel",
        choices=("none", "ddp", "fsdp", "ep"),
        default="none",
        help="under torchrun: split each step over the processes (data parallel, fully sharded, "
        "or expert parallel: fsdp --ep N over all N processes, the dense part whole in each); "
        "see docs/distributed.md",
    )


def _parse_value(text: str):
    import json

    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def train_config(args):
    """The TrainConfig that `k3 train`'s parsed arguments ask for; a ValueError for flags that contradict
    each other (--set against its own flag, --max-steps with --time-budget, a warm-up past the run)."""
    from ..training import TrainConfig

    overrides = {}
    for item in args.set or []:
        if "=" not in item:
            raise ValueError(f"--set expects FIELD=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        overrides[key.strip()] = _parse_value(value)
    for key, flag in (("hidden_size", "--hidden-size"), ("num_layers", "--num-layers")):
        if getattr(args, key) is not None:
            if key in overrides:
                raise ValueError(
                    f"--set {key}={overrides[key]!r} and {flag} {getattr(args, key)} both set `{key}`; give one"
                )
            overrides[key] = getattr(args, key)
    if "vocab_size" in overrides:
        vocabulary = (
            "--tokenizer byte gives 257 tokens"
            if args.tokenizer == "byte"
            else f"--vocab-size {args.vocab_size} gives the BPE tokenizer's"
        )
        raise ValueError(
            f"--set vocab_size={overrides['vocab_size']!r}: the model's vocabulary is the tokenizer's "
            f"({vocabulary}); drop --set vocab_size and use --vocab-size N (BPE) or --tokenizer byte"
        )
    if args.max_steps is not None and args.time_budget is not None:
        raise ValueError(
            f"--max-steps {args.max_steps} and --time-budget {args.time_budget:g} both set the run's "
            f"length; give one (steps or minutes)"
        )
    _check_warmup(args)
    fields = dict(
        preset=args.preset,
        model_overrides=overrides,
        data=args.data,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_steps=args.warmup,
        schedule=args.schedule,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        max_steps=args.max_steps,
        time_budget=args.time_budget,
        eval_every=args.eval_every,
        eval_tokens=args.eval_tokens,
        checkpoint_every=args.checkpoint_every,
        async_checkpoint=args.async_checkpoint,
        out=args.out,
        overwrite=args.overwrite,
        seed=args.seed,
        threads=args.threads,
        compile=args.compile,
    )
    # given only when asked for (a resumed run takes them even where they equal the defaults)
    for key in _ASKED_BY_NAME:
        if getattr(args, key) is not None:
            fields[key] = None if getattr(args, key) == "none" else getattr(args, key)
    return TrainConfig(**fields)


def _check_warmup(args) -> None:
    """A warm-up longer than the run (--warmup past --max-steps) never reaches --lr: refused, both flags named.
    (A time-budget run's is checked once its step count is planned; a resumed one's by k3.training.resume.)"""
    if args.warmup is None or args.time_budget is not None or args.resume:
        return
    from ..training.config import DEFAULT_MAX_STEPS

    run = args.max_steps or DEFAULT_MAX_STEPS
    if args.warmup > run:
        steps = f"--max-steps {run}" if args.max_steps else f"{run} steps (--max-steps' default)"
        raise ValueError(
            f"--warmup {args.warmup} is longer than the run's {steps}: the learning rate would never reach --lr "
            f"{args.lr:g}; give --warmup at most {run}, or more --max-steps"
        )


_ASKED_BY_NAME = (
    "device",
    "precision",
    "grad_accum",
    "log",
    "final_eval_tokens",
    "optimizer",
    "max_steps",
    "recompute",
    "ep",
    "qk_clip",
)


def run(args) -> int:
    """`k3 train`: the run (`k3.training.train`), resumed with --resume once the checkpoint is checked; a
    signal ends it with 128 + its number (the loop saved a checkpoint first)."""

    from ..training import train
    from ..training.stop import Interrupted, signal_words

    cfg = train_config(args)
    use_threads(args)
    if args.resume:
        from ..training.checkpoint import refuse_resuming_unsaved
        from .preflight import check_checkpoint

        refuse_resuming_unsaved(args.resume)  # a run killed before its first save: said so
        check_checkpoint(args.resume, f"--resume {args.resume}")
    asked = tuple(key for key in _ASKED_BY_NAME if getattr(args, key) is not None)
    try:
        train(cfg, resume=args.resume, progress=not args.no_progress, parallel=args.parallel, asked=asked)
    except Interrupted as e:  # Ctrl-C, SIGTERM or SIGHUP: the loop said what it saved; during start-up, say it here
        from ..training.parallel.dims import launch

        if not e.said and launch().rank == 0:
            kept = f"the checkpoint in --resume {args.resume}" if args.resume else f"--out {args.out}"
            print(
                f"\nk3 train: {signal_words(e.signum)} while starting, before the first step: stopped; nothing was "
                f"trained or saved, and {kept} is as it was",
                file=sys.stderr,
            )
        return 128 + e.signum
    return 0
