"""`k3 generate`: one prompt streamed, a file of prompts as one batch, or (without either) the interactive
mode of `k3.cli.interactive`; `--parallel ep` runs the same prompts on every process of a torchrun."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..runtime import DEVICES
from .argtypes import SEED, THREADS, count, number
from .common import use_threads

NAME = "generate"
PARSER = {
    "help": "stream text from a checkpoint",
    "description": "Stream text from a checkpoint. Without --prompt or --prompt-file, read "
    "prompts from stdin, one a line (typed or piped), and stream each continuation; Ctrl-C "
    "stops a generation, Ctrl-D ends.",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`k3 generate`'s checked arguments, added to its `parser` (made with `PARSER`'s keywords)."""
    parser.add_argument("--checkpoint", required=True, metavar="DIR", help="a checkpoint folder (k3 train --out)")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="one prompt, its continuation streamed")
    prompt.add_argument(
        "--prompt-file",
        metavar="FILE",
        help="one prompt a line (blank lines skipped), generated "
        "as one batch of different lengths; each continuation printed when all are done",
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="prompts from stdin: each one continues the conversation (every prompt and "
        "continuation so far is the context, its cache kept between turns) instead of "
        "starting afresh with an empty cache, the default",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=count(0, "tokens to generate"),
        default=200,
        help="tokens to generate after each prompt",
    )
    parser.add_argument(
        "--ignore-eot",
        action="store_true",
        help="keep generating past <|endoftext|> (by default a continuation ends there, as the "
        "corpus's documents do; the token itself is not printed)",
    )
    parser.add_argument(
        "--temperature", type=number(0, "a sampling temperature (0: greedy)"), default=0.8, help="0: greedy"
    )
    parser.add_argument("--top-k", type=count(1, "tokens kept"), default=50, help="sample from the k likeliest tokens")
    parser.add_argument(
        "--top-p",
        type=number(0, "a probability mass", above=True, high=1),
        help="sample from the likeliest tokens whose probabilities sum to p (default: off)",
    )
    parser.add_argument("--seed", type=SEED, default=0, help="seed of the sampling")
    parser.add_argument("--threads", type=THREADS, help="torch threads (default: all cores)")
    parser.add_argument(
        "--parallel",
        choices=("none", "ep"),
        default="none",
        help="under torchrun: ep splits every MoE layer's routed experts over the processes (each "
        "reads only its own), the tokens exchanged by all-to-all; with --prompt or --prompt-file",
    )
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="auto",
        help="where to generate: auto (the default) picks CUDA, then Apple's MPS, then the CPU",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="decode with a compiled step over a static cache (torch.compile: C++ kernels on the CPU, "
        "which need a C++ compiler; CUDA graphs on CUDA). The first run of a model compiles "
        "(about a minute on 2 cores); later runs load it from the cache in "
        "$TORCHINDUCTOR_CACHE_DIR (default ~/.cache/k3/inductor). Greedy tokens are the same",
    )


def _write_utf8(stream) -> None:
    """Generated text is UTF-8 on stdout whatever the locale: under LC_ALL=C Python's stdout is ASCII and
    a continuation with any other character could not be printed (the prompt was lost)."""
    encoding = (getattr(stream, "encoding", None) or "").replace("-", "").lower()
    if encoding != "utf8" and hasattr(stream, "reconfigure"):
        stream.reconfigure(encoding="utf-8")


def run(args) -> int:
    """Everything the user gave is checked (tokenizer, prompts, the checkpoint's files, its size)
    before the model is built; Ctrl-C stops the stream, keeps what was printed and exits with 130.
    Without --prompt or --prompt-file: prompts from stdin (`k3.cli.interactive`)."""
    import time

    import torch

    from ..inference.generation import check_cache_fits
    from ..io import reading
    from ..models import CausalLM
    from ..runtime import resolve_device
    from ..tokenizer import Tokenizer
    from .interactive import interactive, report, stream_text
    from .preflight import check_checkpoint

    _write_utf8(sys.stdout)
    if args.chat and (args.prompt is not None or args.prompt_file):
        raise ValueError(
            "--chat is for the interactive mode (prompts from stdin): drop --prompt / --prompt-file, or --chat"
        )
    if not Path(args.checkpoint).is_dir():
        found = "is a file, not a checkpoint folder" if Path(args.checkpoint).exists() else "no such folder"
        raise FileNotFoundError(
            f"--checkpoint {args.checkpoint}: {found} (expected the folder that k3 train --out wrote, with "
            f"config.json and model.safetensors)"
        )
    if args.parallel == "ep" and args.prompt is None and not args.prompt_file:
        raise ValueError(
            "--parallel ep takes --prompt or --prompt-file (every process runs the same prompts); "
            "the interactive mode reads stdin in one process"
        )
    if args.compile and args.parallel == "ep":
        raise ValueError("--compile decodes in one process; it does not combine with --parallel ep (drop one)")
    use_threads(args)
    device = resolve_device(args.device)
    if args.compile:
        from ..inference.decode_step import compile_cache_dir
        from ..runtime import check_compiler

        check_compiler(device, "--compile")
        print(
            f"k3 generate: --compile: the first tokens wait while the decode step compiles (about a minute the "
            f"first time for a model and batch size; later runs load it from {compile_cache_dir()})",
            file=sys.stderr,
        )
    with reading(args.checkpoint):  # one whole save, read under the folder's lock (k3.io.reading)
        # every file against the save's manifest, the weights' names and shapes, as `k3 train --resume` does
        check_checkpoint(args.checkpoint, f"--checkpoint {args.checkpoint}")
        tokenizer = Tokenizer.load(args.checkpoint)
        texts, prompts = _prompts(args, tokenizer)
        if args.parallel != "ep":
            model = CausalLM.from_pretrained(args.checkpoint).to(device).eval()
    if args.parallel == "ep":  # outside the lock: the processes share the folder, and wait for each other
        return _generate_expert_parallel(args, tokenizer, texts, prompts, device)
    if not prompts:
        return interactive(args, model, tokenizer)
    check_cache_fits(model, prompts, args.max_new_tokens)  # refused before anything is printed
    if args.prompt_file:
        return _generate_batch(args, model, tokenizer, texts, prompts)
    ids = prompts[0]
    generator = torch.Generator(device).manual_seed(args.seed)  # sampling draws on the model's device
    print(args.prompt, end="", flush=True)
    new: list[int] = []
    start = time.perf_counter()
    try:
        first_step = stream_text(model, tokenizer, ids, args, generator, new)
    except KeyboardInterrupt:
        print(flush=True)
        print(f"[interrupted (Ctrl-C) after {len(new)} tokens]", file=sys.stderr)
        return 130
    print(flush=True)
    report(len(new), time.perf_counter() - start, len(ids), device, first_step)
    return 0


def _generate_expert_parallel(args, tokenizer, texts: list[str], prompts: list[list[int]], device) -> int:
    """`torchrun ... -m k3 generate --parallel ep`: each process holds its share of the experts
    (k3.training.parallel.load_expert_parallel) and runs the same prompts with the same seed, so all
    compute the same tokens; rank 0 prints them."""
    import contextlib
    import os
    import time

    import torch
    import torch.distributed as dist

    from ..training.parallel import load_expert_parallel
    from .interactive import report, stream_text

    model = load_expert_parallel(args.checkpoint, device).eval()
    with contextlib.ExitStack() as quiet:
        quiet.callback(dist.destroy_process_group)
        if dist.get_rank() != 0:  # the same text on every process: rank 0 prints it
            sink = quiet.enter_context(open(os.devnull, "w"))
            quiet.enter_context(contextlib.redirect_stdout(sink))
            quiet.enter_context(contextlib.redirect_stderr(sink))
        if args.prompt_file:
            return _generate_batch(args, model, tokenizer, texts, prompts)
        generator = torch.Generator(device).manual_seed(args.seed)
        print(args.prompt, end="", flush=True)
        new: list[int] = []
        start = time.perf_counter()
        stream_text(model, tokenizer, prompts[0], args, generator, new)
        print(flush=True)
        report(
            len(new),
            time.perf_counter() - start,
            len(prompts[0]),
            f"{device}, {dist.get_world_size()} processes (--parallel ep)",
        )
    return 0


def _prompts(args, tokenizer) -> tuple[list[str], list[list[int]]]:
    """(texts, their token ids): `--prompt`, or each non-blank line of `--prompt-file`, checked; none
    without either (the interactive mode reads them)."""
    from pathlib import Path

    if args.prompt is None and not args.prompt_file:
        return [], []
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
        kind = "a folder" if path.is_dir() else "not a regular file (a device or pipe)" if path.exists() else ""
        raise ValueError(f"--prompt-file {path}: " + (f"is {kind}; give a text file" if kind else "no such file"))
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()  # a BOM (Windows editors write one) is no text
    except UnicodeDecodeError as e:
        raise ValueError(
            f"--prompt-file {path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
            f"{e.start}); save it as UTF-8"
        ) from None
    texts = [line for line in lines if line.strip()]
    if not texts:
        raise ValueError(f"--prompt-file {path}: no prompt in it (one prompt a line)")
    prompts = [tokenizer.encode(text) for text in texts]
    for i, (text, ids) in enumerate(zip(texts, prompts)):
        if not ids:
            raise ValueError(f"--prompt-file {path}: line {i + 1} ({text!r}) is empty after tokenization")
    return texts, prompts


def _generate_batch(args, model, tokenizer, texts: list[str], prompts: list[list[int]]) -> int:
    """`k3 generate --prompt-file`: every line's continuation, generated together (the prefill's progress
    shown past LONG_PROMPT tokens in all)."""
    import contextlib
    import time

    import torch

    from .interactive import LONG_PROMPT, prefill_progress

    device = model.lm_head.weight.device
    generator = torch.Generator(device).manual_seed(args.seed)
    start = time.perf_counter()
    eot = None if args.ignore_eot else tokenizer.eot_id
    total = sum(map(len, prompts))
    with prefill_progress(model, total) if total > LONG_PROMPT else contextlib.nullcontext():
        rows = model.generate(
            prompts,
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            eos_token_id=eot,
            generator=generator,
            compile=getattr(args, "compile", False),
        )
    seconds = time.perf_counter() - start
    new = 0
    for i, (text, ids, row) in enumerate(zip(texts, prompts, rows)):
        new += row.numel() - len(ids)
        print(f"--- prompt {i + 1} of {len(texts)}")
        print(text + tokenizer.decode([t for t in row[len(ids) :].tolist() if t != eot]), flush=True)
    print(
        f"[{len(texts)} prompts ({min(map(len, prompts))} to {max(map(len, prompts))} tokens), {new} new tokens "
        f"in {seconds:.2f} s: {new / max(seconds, 1e-9):.1f} tokens/s, prefill included; on {device}]",
        file=sys.stderr,
    )
    return 0
