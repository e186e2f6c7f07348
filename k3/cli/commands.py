"""What each `k3` subcommand does, given its parsed arguments (`k3.cli.parser` defines them)."""

from __future__ import annotations

import sys


def _bench_ops(args) -> int:
    from ..bench import ops

    if args.quick:
        lengths, chunk_sizes, repeats = (512, 2048, 8192), (32, 64), 2
    else:
        lengths, chunk_sizes, repeats = tuple(args.T), tuple(args.chunk_sizes), args.repeats
    ops.run(
        lengths=lengths, chunk_sizes=chunk_sizes, heads=args.heads, dim=args.dim, repeats=repeats, json_path=args.json
    )
    return 0


def _use_threads(args) -> None:
    """torch's threads from --threads, when given; a warning on stderr when they outnumber the cores, a
    ValueError past `max_threads()` (a parser whose --threads is not argtypes' _THREADS still gets the bound)."""
    if args.threads:
        import os

        import torch

        from ..training.config import max_threads, threads_bound_words

        if args.threads > max_threads():
            raise ValueError(
                f"--threads {args.threads}: expected torch threads, an integer in [1, {max_threads()}] "
                f"({threads_bound_words()})"
            )
        cores = os.cpu_count()
        if cores and args.threads > cores:
            print(
                f"k3 {args.command}: warning: --threads {args.threads} is more than this machine's {cores} cores; "
                f"threads beyond the cores wait for each other and slow the work down (default: all cores)",
                file=sys.stderr,
            )
        torch.set_num_threads(args.threads)


def _bench_backward(args) -> int:
    from ..bench import backward

    _use_threads(args)
    if args.quick:
        backward.run(ops=("kda",), rounds=5, json_path=args.json)
    else:
        backward.run(rounds=args.rounds, json_path=args.json)
    return 0


def _bench_profile(args) -> int:
    from ..bench import profile

    _use_threads(args)
    profile.run(rounds=args.rounds, json_path=args.json, data=args.data)
    return 0


def _bench_models(args) -> int:
    from ..bench import models

    _use_threads(args)
    if args.compile:
        from ..bench import compiled

        compiled.run(
            quick=args.quick,
            contexts=args.contexts,
            batch=args.batch,
            steps=args.steps,
            n_threads=args.threads,
            json_path=args.json,
        )
        return 0
    models.run(
        quick=args.quick,
        contexts=args.contexts,
        prefill=args.prefill,
        train=args.train,
        batch=args.batch,
        rounds=args.rounds,
        steps=args.steps,
        models=args.models or models.MODELS,
        n_threads=args.threads,
        json_path=args.json,
    )
    return 0


def _bench_serve(args) -> int:
    from ..bench import serve
    from ..serve import require_serve_extra

    require_serve_extra("k3 bench serve")
    if args.disconnect is not None and args.soak is None:
        raise ValueError(f"--disconnect {args.disconnect:g}: a setting of the --soak load; give --soak SECONDS too")
    from .argtypes import size_flag

    cache_memory = size_flag(args.cache_memory, "--cache-memory")
    _use_threads(args)
    serve.run(
        quick=args.quick,
        duration=args.duration,
        clients=args.clients,
        contexts=tuple(args.contexts),
        cache_memory=cache_memory,
        threads=args.threads,
        soak=args.soak,
        disconnect=0.3 if args.disconnect is None else args.disconnect,
        json_path=args.json,
        parts=tuple(args.parts),
        stream_interval=args.stream_interval,
    )
    return 0


def _plan(args) -> int:
    import json

    from ..plan.commands import run_plan

    plans = run_plan(args)
    if args.json:
        print(json.dumps([f.to_json() for f in plans] if len(plans) > 1 else plans[0].to_json(), indent=2))
    else:
        print("\n\n".join(f.format() for f in plans))
    return 0


def _bench_train(args) -> int:
    from ..bench import train

    train.run(minutes=args.minutes, json_path=args.json, data=args.data)
    return 0


def _bench_gpu(args) -> int:
    from ..bench import gpu

    settings = gpu.TINY if args.tiny else gpu.Settings()
    if args.dry_run:
        print("\n".join(gpu.describe(settings)))
        return 0
    if args.device != "cpu" and not args.device.startswith("cuda"):
        raise ValueError(f"--device must be cuda (or cpu with --tiny), got {args.device!r}")
    if args.device == "cpu" and not args.tiny:
        raise ValueError("--device cpu runs only with --tiny: the full sizes are for a GPU")
    gpu.run(settings, args.device, args.json, parts=tuple(args.parts))
    return 0


def _bench_parallel(args) -> int:
    from ..bench import parallel, saves
    from ..models import PRESETS

    if args.preset not in PRESETS:  # before any process is spawned
        raise ValueError(f"--preset {args.preset!r} is no preset; the presets are: {', '.join(PRESETS)}")
    if args.saves:  # the step time around a save, sync against async
        saves.run(2, args.preset, seq_len=args.seq_len, batch_size=args.batch_size, json_path=args.json)
        return 0
    layouts = []
    for text in args.layouts:
        try:
            world, ep = (int(part) for part in text.split(":"))
        except ValueError:
            raise ValueError(f"--layouts takes N:EP pairs (processes : ep), e.g. 4:2, got {text!r}") from None
        if world < 1 or ep < 1 or world % ep or args.batch_size % world:
            raise ValueError(f"--layouts {text}: ep must divide {world}, {world} divide --batch-size {args.batch_size}")
        layouts.append((world, ep))
    parallel.run(tuple(layouts), args.preset, args.seq_len, args.batch_size, args.json, tuple(args.precision))
    return 0


def _parse_value(text: str):
    import json

    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _train_config(args):
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


def _train(args) -> int:
    import os

    from ..training import train
    from ..training.stop import Interrupted, signal_words

    cfg = _train_config(args)
    _use_threads(args)
    if args.resume:
        from ..training.checkpoint import refuse_resuming_unsaved
        from .preflight import check_checkpoint

        refuse_resuming_unsaved(args.resume)  # a run killed before its first save: said so
        check_checkpoint(args.resume, f"--resume {args.resume}")
    asked = tuple(key for key in _ASKED_BY_NAME if getattr(args, key) is not None)
    try:
        train(cfg, resume=args.resume, progress=not args.no_progress, parallel=args.parallel, asked=asked)
    except Interrupted as e:  # Ctrl-C, SIGTERM or SIGHUP: the loop said what it saved; during start-up, say it here
        if not e.said and os.environ.get("RANK", "0") == "0":
            kept = f"the checkpoint in --resume {args.resume}" if args.resume else f"--out {args.out}"
            print(
                f"\nk3 train: {signal_words(e.signum)} while starting, before the first step: stopped; nothing was "
                f"trained or saved, and {kept} is as it was",
                file=sys.stderr,
            )
        return 128 + e.signum
    return 0


def _export(args) -> int:
    try:
        from ..hf.export import export
        from .preflight import check_pretrained

        check_pretrained(args.checkpoint, f"checkpoint {args.checkpoint}")
        names = export(args.checkpoint, args.out, format=args.format, quantize=args.quantize, outtype=args.outtype)
    except ModuleNotFoundError as e:  # transformers or gguf missing: say so without a traceback
        if e.name not in ("transformers", "gguf"):
            raise
        raise ValueError(str(e)) from e
    print(f"wrote {', '.join(names)} to {args.out} ({args.format} format)")
    return 0


def _lab(args) -> int:
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


def _eval(args) -> int:
    try:
        from ..eval.lm_eval import main as lm_eval_main
    except ModuleNotFoundError as e:
        if e.name is None or not e.name.startswith("lm_eval"):
            raise
        raise ValueError("lm-evaluation-harness is not installed; pip install 'k3[eval]' (or lm-eval)") from e
    return lm_eval_main(args.lm_eval_args)
