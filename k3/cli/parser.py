"""The `k3` command line's arguments: every subcommand, with each number checked as it is parsed."""

from __future__ import annotations

import argparse

from .. import __version__
from ..runtime import DEVICES
from ..training.config import MAX_TIME_BUDGET
from .argtypes import _SEED, _THREADS, _count, _number, _Parser
from .bench_parser import add_bench_parser
from .commands import (
    _eval,
    _export,
    _lab,
    _plan,
    _train,
)
from .generate import _generate
from .params import add_params_parser
from .serve_parser import add_serve_parser


def _torch_version() -> str:
    import torch

    return torch.__version__


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="k3", description="Kimi K3 and its lineage in PyTorch.")
    parser.add_argument("--version", action="version", version=f"k3 {__version__} (torch {_torch_version()})")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model on a text corpus (default: Shakespeare)")
    train.add_argument("--preset", default="kimi-k3-tiny", help="model preset (k3 params lists them)")
    train.add_argument("--hidden-size", type=_count(1, "a width"), help="override the preset's width")
    train.add_argument(
        "--num-layers", type=_count(1, "a depth"), help="override the preset's depth (its layer pattern is kept)"
    )
    train.add_argument(
        "--set",
        action="append",
        metavar="FIELD=VALUE",
        help="override any ModelConfig field, e.g. --set num_experts=8 (repeatable)",
    )
    train.add_argument("--data", help="a UTF-8 text file or folder (default: Shakespeare's works, fetched once)")
    train.add_argument(
        "--tokenizer",
        choices=("bpe", "byte"),
        default="bpe",
        help="byte-level BPE trained on the corpus, or the 256 bytes themselves",
    )
    train.add_argument(
        "--vocab-size",
        type=_count(257, "BPE entries (256 bytes + <|endoftext|> + merges)"),
        default=4096,
        help="BPE vocabulary size",
    )
    train.add_argument("--seq-len", type=_count(1, "tokens per sequence"), default=256, help="tokens per sequence")
    train.add_argument(
        "--batch-size",
        type=_count(1, "sequences per step"),
        default=8,
        help="sequences per step, or per micro-batch with --grad-accum (default 8: in a fixed time "
        "budget, more smaller steps learn more)",
    )
    train.add_argument(
        "--grad-accum",
        type=_count(1, "micro-batches per optimizer step"),
        metavar="N",
        help="N micro-batches of --batch-size per optimizer step (default 1): the step of an N "
        "times larger batch, in the memory of one micro-batch",
    )
    train.add_argument(
        "--optimizer",
        choices=("muon", "adamw"),
        help="muon (the default, as Kimi trains): Muon on the hidden matrices, AdamW on the "
        "embeddings, head and vectors, one learning rate for both; or adamw on everything",
    )
    train.add_argument(
        "--lr",
        type=_number(0, "a learning rate", above=True),
        default=3e-3,
        help="peak learning rate (Muon's and AdamW's)",
    )
    train.add_argument(
        "--warmup",
        type=_count(0, "warmup steps"),
        help="linear warm-up steps (default: 5%% of the run's steps, at most 50)",
    )
    train.add_argument(
        "--schedule",
        choices=("cosine", "wsd"),
        default="wsd",
        help="after the warmup: constant then a linear decay over the last 20%% (wsd, the default: "
        "a time budget re-planned on the way changes nothing before the decay), or cosine",
    )
    train.add_argument(
        "--weight-decay",
        type=_number(0, "a weight decay"),
        default=0.1,
        help="decoupled weight decay of the matrices (norms, biases and gate parameters: none)",
    )
    train.add_argument(
        "--grad-clip",
        type=_number(0, "a gradient norm", above=True),
        default=1.0,
        help="clip the gradient norm to this",
    )
    train.add_argument(
        "--qk-clip",
        type=_number(0, "a logit bound (0: off)"),
        metavar="TAU",
        help="QK-Clip (MuonClip's): after each step, scale down the query and key weights of every "
        "attention head whose largest logit went above TAU, to TAU (default 100 with Muon, off "
        "with adamw; 0 turns it off)",
    )
    train.add_argument(
        "--max-steps",
        type=_count(1, "training steps"),
        help="training steps (default 1000 unless --time-budget; not with --time-budget)",
    )
    train.add_argument(
        "--time-budget",
        type=_number(0, "minutes", above=True, high=MAX_TIME_BUDGET),
        metavar="MIN",
        help="train for about this many minutes (the step count planned from the steps' speed; not with --max-steps)",
    )
    train.add_argument(
        "--eval-every",
        type=_count(1, "steps between evaluations"),
        default=100,
        help="evaluate on the validation split every N steps",
    )
    train.add_argument(
        "--eval-tokens",
        type=_count(1, "validation tokens"),
        default=32768,
        help="validation tokens per periodic evaluation (default 32768)",
    )
    train.add_argument(
        "--final-eval-tokens",
        type=_count(0, "validation tokens (0: no final evaluation)"),
        metavar="N",
        help="validation tokens of the final evaluation (default 262144; 0 skips it)",
    )
    train.add_argument(
        "--checkpoint-every",
        type=_count(1, "steps between checkpoints"),
        help="also save every N steps (default: at the end only)",
    )
    train.add_argument(
        "--async-checkpoint",
        action="store_true",
        help="--parallel fsdp | ep: a save copies the state to CPU memory and the next step starts while a "
        "thread writes the files (torch.distributed.checkpoint.async_save); still committed all-or-nothing, "
        "and finished before the next save and the end of training",
    )
    train.add_argument("--out", default="runs/k3", help="checkpoint directory (and the run's metrics.jsonl)")
    train.add_argument("--resume", metavar="DIR", help="continue the run saved in DIR")
    train.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the k3 checkpoint already in --out with this new run (without it, a new run "
        "refuses such a folder; files k3 did not write are never replaced)",
    )
    train.add_argument("--seed", type=_SEED, default=0, help="seed of the initial weights and the data order")
    train.add_argument(
        "--threads",
        type=_THREADS,
        help="torch threads (default: all cores); 1 is often faster on a machine busy with other "
        "work, where threads wait for each other",
    )
    train.add_argument(
        "--device",
        choices=DEVICES,
        help="where to train: auto (the default) picks CUDA, then Apple's MPS, then the CPU",
    )
    train.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        help="bf16: the forward passes under bfloat16 autocast, float32 weights and optimizer states, "
        "float32 states in the linear-attention ops (default fp32)",
    )
    train.add_argument(
        "--log",
        choices=("tensorboard", "wandb", "none"),
        help="also send OUT/metrics.jsonl's figures to TensorBoard (OUT/tensorboard) or wandb "
        "(needs the package; default none)",
    )
    train.add_argument(
        "--ep",
        type=_count(1, "ranks of an expert-parallel group"),
        metavar="N",
        help="with --parallel fsdp: split every MoE layer's experts over groups of N processes, each "
        "expert sharded over the processes that hold it (default 1: fsdp alone)",
    )
    train.add_argument(
        "--recompute",
        choices=("none", "full", "selective"),
        help="activation recompute: full keeps only each decoder layer's inputs and runs its "
        "forward again in the backward pass; selective does so on every 2nd layer (default none)",
    )
    train.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the decoder: ~0.8x the step time after ~2.5 min of compiling (CPU, "
        "kimi-k3-tiny); worth it for long runs, not the 13-minute demo; needs a C++ compiler",
    )
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument(
        "--parallel",
        choices=("none", "ddp", "fsdp", "ep"),
        default="none",
        help="under torchrun: split each step over the processes (data parallel, fully sharded, "
        "or expert parallel: fsdp --ep N over all N processes, the dense part whole in each); "
        "see docs/distributed.md",
    )
    train.set_defaults(func=_train)
    gen = sub.add_parser(
        "generate",
        help="stream text from a checkpoint",
        description="Stream text from a checkpoint. Without --prompt or --prompt-file, read "
        "prompts from stdin, one a line (typed or piped), and stream each continuation; Ctrl-C "
        "stops a generation, Ctrl-D ends.",
    )
    gen.add_argument("--checkpoint", required=True, metavar="DIR", help="a checkpoint folder (k3 train --out)")
    prompt = gen.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="one prompt, its continuation streamed")
    prompt.add_argument(
        "--prompt-file",
        metavar="FILE",
        help="one prompt a line (blank lines skipped), generated "
        "as one batch of different lengths; each continuation printed when all are done",
    )
    gen.add_argument(
        "--chat",
        action="store_true",
        help="prompts from stdin: each one continues the conversation (every prompt and "
        "continuation so far is the context, its cache kept between turns) instead of "
        "starting afresh with an empty cache, the default",
    )
    gen.add_argument(
        "--max-new-tokens",
        type=_count(0, "tokens to generate"),
        default=200,
        help="tokens to generate after each prompt",
    )
    gen.add_argument(
        "--ignore-eot",
        action="store_true",
        help="keep generating past <|endoftext|> (by default a continuation ends there, as the "
        "corpus's documents do; the token itself is not printed)",
    )
    gen.add_argument(
        "--temperature", type=_number(0, "a sampling temperature (0: greedy)"), default=0.8, help="0: greedy"
    )
    gen.add_argument("--top-k", type=_count(1, "tokens kept"), default=50, help="sample from the k likeliest tokens")
    gen.add_argument(
        "--top-p",
        type=_number(0, "a probability mass", above=True, high=1),
        help="sample from the likeliest tokens whose probabilities sum to p (default: off)",
    )
    gen.add_argument("--seed", type=_SEED, default=0, help="seed of the sampling")
    gen.add_argument("--threads", type=_THREADS, help="torch threads (default: all cores)")
    gen.add_argument(
        "--parallel",
        choices=("none", "ep"),
        default="none",
        help="under torchrun: ep splits every MoE layer's routed experts over the processes (each "
        "reads only its own), the tokens exchanged by all-to-all; with --prompt or --prompt-file",
    )
    gen.add_argument(
        "--device",
        choices=DEVICES,
        default="auto",
        help="where to generate: auto (the default) picks CUDA, then Apple's MPS, then the CPU",
    )
    gen.add_argument(
        "--compile",
        action="store_true",
        help="decode with a compiled step over a static cache (torch.compile: C++ kernels on the CPU, "
        "which need a C++ compiler; CUDA graphs on CUDA). The first run of a model compiles "
        "(about a minute on 2 cores); later runs load it from the cache in "
        "$TORCHINDUCTOR_CACHE_DIR (default ~/.cache/k3/inductor). Greedy tokens are the same",
    )
    gen.set_defaults(func=_generate)
    add_serve_parser(sub)
    export = sub.add_parser("export", help="write a checkpoint in transformers', Kimi's or llama.cpp's (GGUF) format")
    export.add_argument("checkpoint", metavar="CHECKPOINT", help="a k3 checkpoint directory (k3 train --out)")
    export.add_argument("out", metavar="DIR", help="output directory: new or empty (an export never writes over files)")
    export.add_argument(
        "--format",
        choices=("k3", "kimi-linear", "kimi-k3", "gguf"),
        default="k3",
        help="k3 (default): transformers' Auto classes, with trust_remote_code=True or after `import k3.hf`; "
        "kimi-linear: Kimi Linear's own format; kimi-k3: Kimi K3's published layout; gguf: DIR/model.gguf "
        "for llama.cpp (Kimi K3, Kimi Linear and GPT-2 models; needs k3[gguf])",
    )
    export.add_argument("--outtype", choices=("f32", "bf16", "q8_0"), help="gguf: the matrices' type (default f32)")
    export.add_argument(
        "--quantize",
        choices=("mxfp4", "bf16"),
        help="kimi-k3: how the routed experts are stored: mxfp4 (compressed-tensors MXFP4; MXFP4 codes "
        "the checkpoint holds are copied byte for byte) or bf16 (MXFP4 decoded); default: as the "
        "checkpoint stores them",
    )
    export.set_defaults(func=_export)
    add_params_parser(sub)
    plan = sub.add_parser("plan", help="what training or serving a model takes at cluster scale, on paper")
    from ..plan.commands import add_plan_arguments

    add_plan_arguments(plan)
    plan.set_defaults(func=_plan)
    add_bench_parser(sub)
    lab = sub.add_parser("lab", help="the article's claims as experiments: tables and plots in runs/lab/results.md")
    lab.add_argument(
        "name", help="an experiment (recall, overwrite, prefill, decode, parts, inspect, lineage) or 'all'"
    )
    size = lab.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the default: all experiments in about 40 minutes")
    size.add_argument("--full", action="store_true", help="the larger sweeps")
    size.add_argument("--smoke", action="store_true", help="seconds per experiment: checks that it runs")
    lab.add_argument(
        "--docs",
        default="runs/lab",
        help="where results.md, lab/*.json and figures/ go (default "
        "runs/lab; --docs docs regenerates the repository's docs/results.md)",
    )
    lab.add_argument("--checkpoint", help="k3 lab inspect: a checkpoint folder (default: train one briefly)")
    lab.set_defaults(func=_lab)
    # everything after `k3 eval` goes to lm-eval's command line (main passes it on as lm_eval_args)
    lm_eval = sub.add_parser(
        "eval",
        add_help=False,
        help="lm-evaluation-harness with the k3 model: k3 eval "
        "--model_args checkpoint=DIR --tasks TASK ... (lm_eval's options)",
    )
    lm_eval.set_defaults(func=_eval)
    return parser
