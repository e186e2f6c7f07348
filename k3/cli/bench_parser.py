"""`k3 bench`'s subcommands and their checked arguments (`k3.cli.parser` adds them to `k3`'s parser)."""

from __future__ import annotations

from ..bench.serve import PARTS as SERVE_PARTS
from .argtypes import _THREADS, _count, _number
from .commands import (
    _bench_backward,
    _bench_gpu,
    _bench_models,
    _bench_ops,
    _bench_parallel,
    _bench_profile,
    _bench_serve,
    _bench_train,
    _use_threads,
)


def add_bench_parser(sub) -> None:
    """`k3 bench` and its subcommands, added to the subparsers `sub` of `k3`'s parser."""
    bench = sub.add_parser("bench", help="benchmarks (ratios measured side by side in one run)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    ops = bench_sub.add_parser("ops", help="recurrent vs chunk mixers vs causal SDPA")
    ops.add_argument("--quick", action="store_true", help="T in {512, 2048, 8192}, C in {32, 64}: about two minutes")
    ops.add_argument("--T", type=_count(1, "tokens"), nargs="+", default=[512, 2048, 8192], help="sequence lengths")
    ops.add_argument(
        "--chunk-sizes", type=_count(1, "tokens a chunk"), nargs="+", default=[16, 32, 64, 128], help="chunk sizes C"
    )
    ops.add_argument("--heads", type=_count(1, "heads"), default=8, help="heads H")
    ops.add_argument("--dim", type=_count(1, "a head dimension"), default=64, help="head dim K = V")
    ops.add_argument(
        "--repeats", type=_count(1, "timed runs"), default=3, help="timed runs per case (the best is kept)"
    )
    ops.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    ops.set_defaults(func=_bench_ops)
    bbackward = bench_sub.add_parser(
        "backward",
        help="the delta family's own chunkwise backward vs autograd through the forward: time and peak memory",
    )
    bbackward.add_argument("--quick", action="store_true", help="KDA only, fewer rounds: under a minute")
    bbackward.add_argument("--threads", type=_THREADS, help="torch threads (default: all cores)")
    bbackward.add_argument(
        "--rounds", type=_count(1, "timing rounds"), default=15, help="interleaved timing rounds (default 15)"
    )
    bbackward.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    bbackward.set_defaults(func=_bench_backward)
    bprofile = bench_sub.add_parser(
        "profile",
        help="one training step of kimi-k3-tiny and its matched GPT-2, "
        "part by part: forward and backward ms of every layer's parts",
    )
    bprofile.add_argument(
        "--rounds", type=_count(1, "timing rounds"), default=5, help="interleaved timing rounds (default 5)"
    )
    bprofile.add_argument("--threads", type=_THREADS, help="torch threads (default: all cores)")
    bprofile.add_argument("--data", help="corpus (default: Shakespeare)")
    bprofile.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    bprofile.set_defaults(func=_bench_profile)
    btrain = bench_sub.add_parser("train", help="kimi-k3-tiny vs a GPT-2 of equal width and parameters")
    btrain.add_argument(
        "--minutes", type=_number(0, "minutes", above=True), default=5.0, help="training budget of each model"
    )
    btrain.add_argument("--data", help="corpus (default: Shakespeare)")
    btrain.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    btrain.set_defaults(func=_bench_train)
    bparallel = bench_sub.add_parser(
        "parallel",
        help="bytes each process of fsdp x ep sends in a step and its peak "
        "memory, measured on gloo processes beside k3 plan's model",
    )
    bparallel.add_argument(
        "--layouts",
        nargs="+",
        default=["2:1", "2:2", "4:2"],
        metavar="N:EP",
        help="process counts and ep, each N:EP (default 2:1 2:2 4:2)",
    )
    bparallel.add_argument("--preset", default="kimi-k3-tiny", help="the model (default kimi-k3-tiny)")
    bparallel.add_argument(
        "--seq-len", type=_count(1, "tokens a sequence"), default=256, help="tokens a sequence (default 256)"
    )
    bparallel.add_argument(
        "--batch-size", type=_count(1, "sequences"), default=8, help="sequences a step, over all processes (8)"
    )
    bparallel.add_argument(
        "--precision",
        nargs="+",
        choices=("fp32", "bf16"),
        default=["fp32", "bf16"],
        help="k3 train's --precision of the jobs: fp32 with recompute none and full, bf16 with none (default both)",
    )
    bparallel.add_argument(
        "--saves",
        action="store_true",
        help="instead: the step time around a checkpoint, synchronous against --async-checkpoint "
        "(2 processes, --preset, --seq-len, --batch-size)",
    )
    bparallel.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    bparallel.set_defaults(func=_bench_parallel)
    bgpu = bench_sub.add_parser(
        "gpu",
        help="the device check on one CUDA GPU: the CUDA tests, fla's kernels behind k3's ops, a ~1B Kimi K3 "
        "training step (tokens/s, MFU), the compiled decode step vs transformers: under 8 minutes",
    )
    bgpu.add_argument("--dry-run", action="store_true", help="print what would run and time; needs no GPU")
    bgpu.add_argument(
        "--tiny", action="store_true", help="every part at toy sizes, eager, on any device (a smoke test: seconds)"
    )
    bgpu.add_argument("--device", default="cuda", help="the device (default cuda; --tiny also runs on cpu)")
    bgpu.add_argument(
        "--parts",
        nargs="+",
        choices=("tests", "ops", "train", "decode"),
        default=["tests", "ops", "train", "decode"],
        help="which parts to run, in the report's order (default all)",
    )
    bgpu.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    bgpu.set_defaults(func=_bench_gpu)
    bmodels = bench_sub.add_parser(
        "models", help="whole-model prefill, train step and decode speed, k3 vs GPT-2 and transformers"
    )
    bmodels.add_argument(
        "--quick", action="store_true", help="fewer rounds and steps, a smaller train step: about a minute"
    )
    bmodels.add_argument("--threads", type=_THREADS, help="torch threads (default: all cores)")
    bmodels.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    bmodels.add_argument(
        "--models",
        nargs="+",
        metavar="NAME",
        help="a subset of: kimi-k3-tiny kimi-linear-tiny "
        "gpt2-tiny transformers-gpt2 transformers-kimi-linear (default: all)",
    )
    bmodels.add_argument("--contexts", type=_count(1, "tokens"), nargs="+", help="decode contexts (default 256 4096)")
    bmodels.add_argument("--prefill", type=_count(1, "tokens"), help="prefill tokens (default 2048)")
    bmodels.add_argument(
        "--train",
        type=_count(1, "a size"),
        nargs=2,
        metavar=("B", "T"),
        help="train step shape (default 16 256; quick 8 256)",
    )
    bmodels.add_argument(
        "--batch", type=_count(1, "sequences"), nargs=2, metavar=("B1", "B2"), help="decode batches compared (1 8)"
    )
    bmodels.add_argument(
        "--rounds", type=_count(1, "rounds"), help="interleaved rounds of prefill and train step (default 3; quick 2)"
    )
    bmodels.add_argument(
        "--steps",
        type=_count(1, "decode steps"),
        help="timed decode steps per model and context (default 24; quick 16)",
    )
    bmodels.add_argument(
        "--compile",
        action="store_true",
        help="instead: eager and compiled decode ms/token (static cache, inductor) of kimi-k3-tiny, "
        "kimi-linear-tiny and the matched GPT-2 at each context and batch, and the compile times "
        "(first, cached) in fresh processes; needs a C++ compiler",
    )
    bmodels.set_defaults(func=_bench_models)
    bserve = bench_sub.add_parser(
        "serve",
        help="k3 serve under load: throughput, latency and concurrent sequences "
        "in one cache budget, kimi-k3-tiny vs kimi-linear-tiny vs the matched GPT-2",
    )
    bserve.add_argument("--quick", action="store_true", help="20 s per load instead of 60 s: about 4 minutes")
    bserve.add_argument("--duration", type=_number(0, "seconds", above=True), help="seconds per load")
    bserve.add_argument("--clients", type=_count(1, "concurrent clients"), default=64, help="concurrent clients")
    bserve.add_argument(
        "--contexts",
        type=_count(2, "tokens"),
        nargs="+",
        default=[256, 4096],
        help="contexts (prompt + output, half each)",
    )
    bserve.add_argument("--cache-memory", default="128MiB", metavar="SIZE", help="the servers' cache budget")
    bserve.add_argument("--threads", type=_THREADS, help="the servers' torch threads")
    bserve.add_argument(
        "--soak",
        type=_number(0, "seconds", above=True),
        metavar="SECONDS",
        help="instead: one long load on kimi-k3-tiny whose clients disconnect at random; reports "
        "failures and slots left held",
    )
    bserve.add_argument(
        "--disconnect",
        type=_number(0, "a fraction", high=1),
        help="--soak: the fraction of requests that disconnect mid-stream (default 0.3)",
    )
    bserve.add_argument(
        "--parts",
        nargs="+",
        choices=SERVE_PARTS,
        default=list(SERVE_PARTS),
        help="which loads: models (the three models, eager), batching (1 and 16 clients), engine (eager vs "
        "compiled steps), poisson (arrivals near saturation, prefill chunked and not), prefix (a shared "
        "system prompt, prefix cache on and off), long (a 16,384-token prompt arriving under load, and the "
        "same load without it)",
    )
    bserve.add_argument(
        "--stream-interval",
        type=_count(1, "tokens"),
        default=1,
        help="the servers' --stream-interval: a streamed event every N tokens after the first (default 1)",
    )
    bserve.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    bserve.set_defaults(func=_bench_serve)
    bllama = bench_sub.add_parser(
        "llama", help="k3 (eager, compiled) beside llama.cpp (f32, q8_0) on the same weights: prefill and decode"
    )
    bllama.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    bllama.add_argument(
        "--models", nargs="+", metavar="NAME", help="a subset of: kimi-k3-tiny kimi-linear-tiny gpt2-tiny kimi-k3-100m"
    )
    bllama.add_argument("--contexts", type=_count(1, "tokens"), nargs="+", help="decode contexts (default 256 4096)")
    bllama.add_argument("--steps", type=_count(1, "decode steps"), help="timed decode steps (default 24; quick 12)")
    bllama.add_argument("--threads", type=_THREADS, help="torch's and llama.cpp's (default: all cores)")
    bllama.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    bllama.set_defaults(func=_bench_llama)


def _bench_llama(args) -> int:
    from ..bench import llama

    _use_threads(args)
    try:
        llama.run(args.quick, args.models, args.contexts, args.steps, args.threads, args.json)
    except ModuleNotFoundError as e:
        if e.name != "llama_cpp":
            raise
        raise ValueError(str(e)) from e
    return 0
