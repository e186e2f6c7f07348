"""The `k3` command line: `k3 train`, `k3 generate`, `k3 export`, `k3 params`, `k3 bench ops|train|models`,
`k3 lab`, `k3 eval`.

A failure the user can cause ends in one line, `k3 <command>: error: ...` (the value, what was expected,
what to do), and exit code 2: a flag out of range (checked as it is parsed), a ValueError or OSError
raised for bad input (a setting, a file that is missing, damaged or too big for memory), argparse's
own errors. Ctrl-C ends with exit code 130 (`k3 generate` keeps what it printed; `k3 train` saves a
checkpoint first). Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import math
import sys


def _bench_ops(args) -> int:
    from .bench import ops

    if args.quick:
        lengths, chunk_sizes, repeats = (512, 2048), (32, 64), 2
    else:
        lengths, chunk_sizes, repeats = tuple(args.T), tuple(args.chunk_sizes), args.repeats
    ops.run(lengths=lengths, chunk_sizes=chunk_sizes, heads=args.heads, dim=args.dim, repeats=repeats,
            json_path=args.json)
    return 0


def _bench_models(args) -> int:
    from .bench import models

    models.run(quick=args.quick, contexts=args.contexts, prefill=args.prefill, train=args.train, batch=args.batch,
               rounds=args.rounds, steps=args.steps, models=args.models or models.MODELS, n_threads=args.threads,
               json_path=args.json)
    return 0


def _params(args) -> int:
    from .models import PRESETS, get_config
    from .models.params import count_params, format_report

    if args.preset is None:
        print("presets: " + ", ".join(PRESETS))
        return 0
    config = get_config(args.preset)
    vs = get_config(args.vs) if args.vs else None
    if args.json:
        import dataclasses
        import json

        print(json.dumps({"preset": args.preset, **dataclasses.asdict(count_params(config))}, indent=2))
    else:
        print(format_report(config, vs))
    return 0


def _bench_train(args) -> int:
    from .bench import train

    train.run(minutes=args.minutes, json_path=args.json, data=args.data)
    return 0


def _parse_value(text: str):
    import json

    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _train_config(args):
    from .training import TrainConfig

    overrides = {}
    for item in args.set or []:
        if "=" not in item:
            raise ValueError(f"--set expects FIELD=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        overrides[key.strip()] = _parse_value(value)
    for flag, key in (("hidden_size", "hidden_size"), ("num_layers", "num_layers")):
        if getattr(args, flag) is not None:
            overrides[key] = getattr(args, flag)
    fields = dict(preset=args.preset, model_overrides=overrides, data=args.data, tokenizer=args.tokenizer,
                  vocab_size=args.vocab_size, seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr,
                  warmup_steps=args.warmup, schedule=args.schedule, weight_decay=args.weight_decay,
                  grad_clip=args.grad_clip, max_steps=args.max_steps, time_budget=args.time_budget,
                  eval_every=args.eval_every, eval_tokens=args.eval_tokens, checkpoint_every=args.checkpoint_every,
                  out=args.out, seed=args.seed, threads=args.threads, compile=args.compile)
    if args.time_budget is not None and args.max_steps is None:
        fields["max_steps"] = None
    elif fields["max_steps"] is None:
        fields["max_steps"] = TrainConfig().max_steps
    return TrainConfig(**fields)


def _train(args) -> int:
    from .training import train

    cfg = _train_config(args)
    if args.resume:
        from .models.preflight import check_checkpoint

        check_checkpoint(args.resume, f"--resume {args.resume}")
    try:
        train(cfg, resume=args.resume, progress=not args.no_progress, parallel=args.parallel)
    except KeyboardInterrupt:
        return 130
    return 0


def _generate(args) -> int:
    """Everything the user gave is checked (tokenizer, prompts, the checkpoint's files, its size)
    before the model is built; Ctrl-C stops the stream, keeps what was printed and exits with 130."""
    import time

    import torch

    from .models import CausalLM
    from .models.preflight import check_pretrained
    from .tokenizer import Tokenizer

    tokenizer = Tokenizer.load(args.checkpoint)
    texts, prompts = _prompts(args, tokenizer)
    check_pretrained(args.checkpoint, f"--checkpoint {args.checkpoint}")
    model = CausalLM.from_pretrained(args.checkpoint).eval()
    if args.prompt_file:
        return _generate_batch(args, model, tokenizer, texts, prompts)
    ids = prompts[0]
    generator = torch.Generator().manual_seed(args.seed)
    prompt = torch.tensor([ids])
    print(args.prompt, end="", flush=True)
    new: list[int] = []
    shown = ""
    start = time.perf_counter()
    try:
        for token in model.stream(prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                  top_p=args.top_p, generator=generator):
            new.append(int(token[0]))
            text = tokenizer.decode(new)
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                print(text[len(shown):], end="", flush=True)
                shown = text
    except KeyboardInterrupt:
        print(flush=True)
        print(f"[interrupted (Ctrl-C) after {len(new)} tokens]", file=sys.stderr)
        return 130
    seconds = time.perf_counter() - start
    print(flush=True)
    print(f"[{len(new)} tokens in {seconds:.2f} s: {len(new) / max(seconds, 1e-9):.1f} tokens/s, prefill of "
          f"{len(ids)} prompt tokens included]", file=sys.stderr)
    return 0


def _prompts(args, tokenizer) -> tuple[list[str], list[list[int]]]:
    """(texts, their token ids): `--prompt`, or each non-blank line of `--prompt-file`, checked."""
    from pathlib import Path

    if not args.prompt_file:
        try:
            ids = tokenizer.encode(args.prompt)
        except ValueError as e:
            raise ValueError(f"--prompt: {e}") from None
        if not ids:
            raise ValueError(f"the prompt {args.prompt!r} is empty after tokenization; give some text")
        return [args.prompt], [ids]
    path = Path(args.prompt_file)
    if not path.is_file():
        raise ValueError(f"--prompt-file {path}: no such file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompt-file {path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                         f"{e.start}); save it as UTF-8") from None
    texts = [line for line in lines if line.strip()]
    if not texts:
        raise ValueError(f"--prompt-file {path}: no prompt in it (one prompt a line)")
    prompts = [tokenizer.encode(text) for text in texts]
    for i, (text, ids) in enumerate(zip(texts, prompts)):
        if not ids:
            raise ValueError(f"--prompt-file {path}: line {i + 1} ({text!r}) is empty after tokenization")
    return texts, prompts


def _generate_batch(args, model, tokenizer, texts: list[str], prompts: list[list[int]]) -> int:
    """`k3 generate --prompt-file`: every line's continuation, generated together."""
    import time

    import torch

    generator = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    rows = model.generate(prompts, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, generator=generator)
    seconds = time.perf_counter() - start
    new = 0
    for i, (text, ids, row) in enumerate(zip(texts, prompts, rows)):
        new += row.numel() - len(ids)
        print(f"--- prompt {i + 1} of {len(texts)}")
        print(text + tokenizer.decode(row[len(ids):].tolist()), flush=True)
    print(f"[{len(texts)} prompts ({min(map(len, prompts))} to {max(map(len, prompts))} tokens), {new} new tokens "
          f"in {seconds:.2f} s: {new / max(seconds, 1e-9):.1f} tokens/s, prefill included]", file=sys.stderr)
    return 0


def _export(args) -> int:
    try:
        from .hf.export import export
    except ModuleNotFoundError as e:  # transformers missing: say so without a traceback
        if e.name != "transformers":
            raise
        raise ValueError(str(e)) from e
    from .models.preflight import check_pretrained

    check_pretrained(args.checkpoint, f"checkpoint {args.checkpoint}")
    names = export(args.checkpoint, args.out, format=args.format)
    print(f"wrote {', '.join(names)} to {args.out} ({args.format} format)")
    return 0


def _lab(args) -> int:
    from . import lab

    mode = "full" if args.full else "smoke" if args.smoke else "quick"
    options = {"checkpoint": args.checkpoint} if args.checkpoint else {}
    if options and args.name != "inspect":
        raise ValueError(f"--checkpoint is for `k3 lab inspect`, not `k3 lab {args.name}`")
    if options:
        from .models.preflight import check_checkpoint

        check_checkpoint(args.checkpoint, f"--checkpoint {args.checkpoint}")
    names = list(lab.EXPERIMENTS) if args.name == "all" else [args.name]
    for name in names:
        if name in lab.EXPERIMENTS:
            print(f"k3 lab {name} ({mode}): {lab.EXPERIMENTS[name][1]}", flush=True)
        result = lab.run(name, mode, args.docs, **options)
        print(f"  {sum(c.verdict == 'holds' for c in result.claims)} of {len(result.claims)} claims hold; "
              f"{result.seconds / 60:.1f} min; {len(result.figures)} figures", flush=True)
    print(f"wrote {args.docs}/results.md")
    return 0


def _eval(args) -> int:
    try:
        from .eval.lm_eval import main as lm_eval_main
    except ModuleNotFoundError as e:
        if e.name is None or not e.name.startswith("lm_eval"):
            raise
        raise ValueError("lm-evaluation-harness is not installed; pip install 'k3[eval]' (or lm-eval)") from e
    return lm_eval_main(args.lm_eval_args)


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (the usage of `k3 train` alone takes a dozen)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _count(low: int, what: str):
    """An argparse type: an integer >= low; `what` says what it counts."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"expected {what}, an integer >= {low}, got {text!r}")
        return value
    return parse


def _number(low: float, what: str, above: bool = False, high: float = math.inf):
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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="k3", description="Kimi K3 and its lineage in PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model on a text corpus (default: Shakespeare)")
    train.add_argument("--preset", default="kimi-k3-tiny", help="model preset (k3 params lists them)")
    train.add_argument("--hidden-size", type=_count(1, "a width"), help="override the preset's width")
    train.add_argument("--num-layers", type=_count(1, "a depth"),
                       help="override the preset's depth (its layer pattern is kept)")
    train.add_argument("--set", action="append", metavar="FIELD=VALUE",
                       help="override any ModelConfig field, e.g. --set num_experts=8 (repeatable)")
    train.add_argument("--data", help="a UTF-8 text file or folder (default: Shakespeare's works, fetched once)")
    train.add_argument("--tokenizer", choices=("bpe", "byte"), default="bpe")
    train.add_argument("--vocab-size", type=_count(257, "BPE entries (256 bytes + <|endoftext|> + merges)"),
                       default=4096, help="BPE vocabulary size")
    train.add_argument("--seq-len", type=_count(1, "tokens per sequence"), default=256)
    train.add_argument("--batch-size", type=_count(1, "sequences per step"), default=8,
                       help="sequences per step (default 8: in a fixed time budget, more smaller steps learn more)")
    train.add_argument("--lr", type=_number(0, "a learning rate", above=True), default=3e-3)
    train.add_argument("--warmup", type=_count(0, "warmup steps"), default=50, help="warmup steps")
    train.add_argument("--schedule", choices=("cosine", "wsd"), default="wsd",
                       help="after the warmup: constant then a linear decay over the last 20%% (wsd, the default: "
                            "a time budget re-planned on the way changes nothing before the decay), or cosine")
    train.add_argument("--weight-decay", type=_number(0, "a weight decay"), default=0.1)
    train.add_argument("--grad-clip", type=_number(0, "a gradient norm", above=True), default=1.0)
    train.add_argument("--max-steps", type=_count(1, "training steps"),
                       help="training steps (default 1000 unless --time-budget)")
    train.add_argument("--time-budget", type=_number(0, "minutes", above=True), metavar="MIN",
                       help="train for about this many minutes")
    train.add_argument("--eval-every", type=_count(1, "steps between evaluations"), default=100)
    train.add_argument("--eval-tokens", type=_count(1, "validation tokens"), default=32768,
                       help="validation tokens per evaluation")
    train.add_argument("--checkpoint-every", type=_count(1, "steps between checkpoints"),
                       help="also save every N steps (always at the end)")
    train.add_argument("--out", default="runs/k3", help="checkpoint directory")
    train.add_argument("--resume", metavar="DIR", help="continue the run saved in DIR")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--threads", type=_count(1, "torch threads"), help="torch threads (default: all cores)")
    train.add_argument("--compile", action="store_true",
                       help="torch.compile the decoder: ~0.8x the step time after ~2.5 min of compiling (CPU, "
                            "kimi-k3-tiny); worth it for long runs, not the 13-minute demo; needs a C++ compiler")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument("--parallel", choices=("none", "ddp", "fsdp", "ep"), default="none",
                       help="under torchrun: split each step over the processes (data parallel, fully sharded, "
                            "or expert parallel); see the README")
    train.set_defaults(func=_train)
    gen = sub.add_parser("generate", help="stream text from a checkpoint")
    gen.add_argument("--checkpoint", required=True, metavar="DIR")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="one prompt, its continuation streamed")
    prompt.add_argument("--prompt-file", metavar="FILE", help="one prompt a line (blank lines skipped), generated "
                        "as one batch of different lengths; each continuation printed when all are done")
    gen.add_argument("--max-new-tokens", type=_count(0, "tokens to generate"), default=200)
    gen.add_argument("--temperature", type=_number(0, "a sampling temperature (0: greedy)"), default=0.8,
                     help="0: greedy")
    gen.add_argument("--top-k", type=_count(1, "tokens kept"), default=50)
    gen.add_argument("--top-p", type=_number(0, "a probability mass", above=True, high=1))
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(func=_generate)
    export = sub.add_parser("export", help="write a checkpoint in Hugging Face transformers' format (needs k3[hf])")
    export.add_argument("checkpoint", metavar="CHECKPOINT", help="a k3 checkpoint directory (k3 train --out)")
    export.add_argument("out", metavar="DIR", help="output directory")
    export.add_argument("--format", choices=("k3", "kimi-linear"), default="k3",
                        help="k3: model_type k3, loads after `import k3.hf` (default); kimi-linear: Kimi "
                             "Linear's own format, for kimi-linear* models")
    export.set_defaults(func=_export)
    params = sub.add_parser("params", help="parameter count, active parameters and decode memory of a preset")
    params.add_argument("preset", nargs="?", help="a preset name (omit to list them)")
    params.add_argument("--vs", metavar="PRESET", help="also print the ratio of total parameters to this preset")
    params.add_argument("--json", action="store_true", help="print the figures as JSON")
    params.set_defaults(func=_params)
    bench = sub.add_parser("bench", help="benchmarks (ratios measured side by side in one run)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    ops = bench_sub.add_parser("ops", help="recurrent vs chunk mixers vs causal SDPA")
    ops.add_argument("--quick", action="store_true", help="T in {512, 2048}, C in {32, 64}: about a minute")
    ops.add_argument("--T", type=int, nargs="+", default=[512, 2048, 8192], help="sequence lengths")
    ops.add_argument("--chunk-sizes", type=int, nargs="+", default=[16, 32, 64, 128])
    ops.add_argument("--heads", type=int, default=8)
    ops.add_argument("--dim", type=int, default=64, help="head dim K = V")
    ops.add_argument("--repeats", type=int, default=3, help="timed runs per case (the best is kept)")
    ops.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    ops.set_defaults(func=_bench_ops)
    btrain = bench_sub.add_parser("train", help="kimi-k3-tiny vs a GPT-2 of equal width and parameters")
    btrain.add_argument("--minutes", type=float, default=5.0, help="training budget of each model")
    btrain.add_argument("--data", help="corpus (default: Shakespeare)")
    btrain.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    btrain.set_defaults(func=_bench_train)
    bmodels = bench_sub.add_parser("models", help="whole-model prefill, train step and decode speed, k3 vs GPT-2 "
                                   "and transformers")
    bmodels.add_argument("--quick", action="store_true",
                         help="fewer rounds and steps, a smaller train step: about a minute")
    bmodels.add_argument("--threads", type=int, help="torch threads (default: all cores)")
    bmodels.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    bmodels.add_argument("--models", nargs="+", metavar="NAME", help="a subset of: kimi-k3-tiny kimi-linear-tiny "
                         "gpt2-tiny transformers-gpt2 transformers-kimi-linear (default: all)")
    bmodels.add_argument("--contexts", type=int, nargs="+", help="decode contexts (default 256 4096)")
    bmodels.add_argument("--prefill", type=int, help="prefill tokens (default 2048)")
    bmodels.add_argument("--train", type=int, nargs=2, metavar=("B", "T"),
                         help="train step shape (default 16 256; quick 8 256)")
    bmodels.add_argument("--batch", type=int, nargs=2, metavar=("B1", "B2"), help="decode batches compared (1 8)")
    bmodels.add_argument("--rounds", type=int, help="interleaved rounds of prefill and train step (default 3; quick 2)")
    bmodels.add_argument("--steps", type=int, help="timed decode steps per model and context (default 24; quick 16)")
    bmodels.set_defaults(func=_bench_models)
    lab = sub.add_parser("lab", help="the article's claims as experiments: tables and plots in docs/results.md")
    lab.add_argument("name", help="an experiment (recall, overwrite, prefill, decode, parts, inspect) or 'all'")
    size = lab.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the default: all experiments in under 30 minutes")
    size.add_argument("--full", action="store_true", help="the larger sweeps")
    size.add_argument("--smoke", action="store_true", help="seconds per experiment: checks that it runs")
    lab.add_argument("--docs", default="docs", help="where results.md, lab/*.json and figures/ go")
    lab.add_argument("--checkpoint", help="k3 lab inspect: a checkpoint folder (default: train one briefly)")
    lab.set_defaults(func=_lab)
    # everything after `k3 eval` goes to lm-eval's command line (main passes it on as lm_eval_args)
    lm_eval = sub.add_parser("eval", add_help=False, help="lm-evaluation-harness with the k3 model: k3 eval "
                             "--model_args checkpoint=DIR --tasks TASK ... (lm_eval's options)")
    lm_eval.set_defaults(func=_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .runtime import keep_freed_memory

    parser = build_parser()
    try:
        args, rest = parser.parse_known_args(argv)
        if args.command != "eval" and rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
    except SystemExit as e:  # argparse's errors (2, already printed) and --help (0)
        return e.code if isinstance(e.code, int) else 2
    if args.command == "eval":
        args.lm_eval_args = rest
    keep_freed_memory()
    try:
        return args.func(args)
    except (ValueError, OSError) as e:  # bad input: say what is wrong, no traceback
        print(f"k3 {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nk3 {args.command}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
