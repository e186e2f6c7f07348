"""`k3 serve`: its checked arguments, then the command: the checkpoint loaded and checked as `k3 generate`
checks it, the flags that need more than argparse (sizes, the cache budget against the memory there is, the
API key's source, the open-file limit for --max-connections), then `k3.serve.serve`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..runtime import DEVICES
from ..serve import MAX_CONNECTIONS, REQUEST_TIMEOUT
from ..serve.engine import PREFILL_CHUNK, PREFIX_CACHE
from .argtypes import count, number
from .common import size_flag, use_threads

NAME = "serve"
PARSER = {
    "help": "serve a checkpoint over OpenAI's HTTP API, continuous batching (k3[serve])",
    "description": "Serve a checkpoint over OpenAI's HTTP API (/v1/completions, "
    "/v1/chat/completions, /v1/models, /health) with continuous batching. SIGTERM, SIGHUP or Ctrl-C "
    "stops admitting (new requests get 503 with Retry-After), lets running requests finish "
    "(--shutdown-timeout) and exits; then, or at a second signal, what still runs ends at once: a "
    'stream with finish_reason "abort" and data: [DONE], a whole answer with 503.',
}

# the smallest prefill chunk taken (0 aside): each chunk is one forward, and with the prefix cache one block
# (k3.serve.prefix), which keeps every recurrent layer's state at its end; below this a turn's fixed cost
# dominates (kimi-k3-tiny on CPU, a 1,201-token prompt: 0.13 s at 512, 0.26 s at 64, 0.86 s at 16, 15 s at
# 1) and a prompt's blocks multiply. The engine shrinks a piece to fit its memory down to the same 64.
MIN_PREFILL_CHUNK = 64


def _prefill_chunk(text: str) -> int:
    """An argparse type: 0 (each prompt whole) or at least MIN_PREFILL_CHUNK tokens."""
    value = count(0, "tokens")(text)
    if 0 < value < MIN_PREFILL_CHUNK:
        raise argparse.ArgumentTypeError(
            f"expected 0 (each prompt whole) or at least {MIN_PREFILL_CHUNK} tokens, got {text!r}: each chunk is "
            f"a forward and a prefix-cache block of its own, so a smaller one prefills a long prompt many times "
            f"slower and caches it in as many blocks"
        )
    return value


def _model_name(text: str) -> str:
    """An argparse type: a name a client can send as "model", not blank."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f'expected the name clients send as "model", not blank, got {text!r}')
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`k3 serve`'s checked arguments, added to its `parser` (made with `PARSER`'s keywords)."""
    parser.add_argument(
        "--checkpoint", required=True, metavar="DIR", help="a checkpoint folder (k3 train --out), as k3 generate reads"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    parser.add_argument("--port", type=count(0, "a TCP port", high=65535), default=8000, help="port (0: any free one)")
    parser.add_argument(
        "--cache-memory",
        default="1GiB",
        metavar="SIZE",
        help="bytes of cache, e.g. 512MiB, at most the memory available: the slot pool (--max-running rows "
        "of --max-model-len tokens), the prompts being prefilled and their activations, and the prefix "
        "cache in what is left; a request is admitted when a slot is free and its prefill fits, else it waits",
    )
    parser.add_argument(
        "--max-queue",
        type=count(1, "waiting requests"),
        default=256,
        help="sequences that may wait for room; past this, 503 with Retry-After",
    )
    parser.add_argument(
        "--max-running",
        type=count(1, "sequences"),
        default=256,
        help="slots: sequences prefilled or decoded together at most (fewer when --cache-memory does not "
        "hold that many rows of --max-model-len tokens); more wait in the queue",
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="decode with compiled steps over the slot pool, one graph per batch-size and length bucket "
        "(torch.compile: C++ kernels on the CPU, which need a C++ compiler; CUDA graphs on CUDA), compiled "
        "in the background while eager steps serve (every batch size's first, shorter lengths' as turns "
        "ask; /health counts them), kept in $TORCHINDUCTOR_CACHE_DIR (default ~/.cache/k3/inductor) for "
        "the next start (default: --no-compile, eager steps)",
    )
    parser.add_argument(
        "--prefill-chunk",
        type=_prefill_chunk,
        default=PREFILL_CHUNK,
        help="prompt tokens prefilled per engine turn beside the running sequences' next tokens, so a long "
        "prompt does not stall them (and no more work than this many at a prompt's start: a piece deep in a "
        "long prompt holds fewer); also the prefix cache's block. 0: each prompt "
        f"whole; else at least {MIN_PREFILL_CHUNK}: each chunk costs a forward and a cached block of its own, "
        "so a smaller one is refused (as vLLM refuses --max-num-batched-tokens below --max-num-seqs) "
        f"rather than serve many times slower (default {PREFILL_CHUNK})",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=count(1, "tokens"),
        default=None,
        help="tokens one engine turn's forward takes at most: one for each running sequence, then prompt pieces "
        "(at most --prefill-chunk) in what is left (vLLM's name; default: the running sequences and "
        "--prefill-chunk)",
    )
    parser.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=PREFIX_CACHE,
        help="keep prompts' states in blocks (--prefill-chunk tokens each; recurrent layers' states "
        "snapshotted at the block ends) and resume a prompt from its longest cached prefix: the same "
        "logits as computing it, in the cache budget's spare room "
        f"(default: {'--prefix-cache' if PREFIX_CACHE else '--no-prefix-cache'})",
    )
    parser.add_argument(
        "--stream-interval", type=count(1, "tokens"), default=1, help="a streamed event every N tokens after the first"
    )
    parser.add_argument(
        "--max-request-bytes",
        default="1MiB",
        metavar="SIZE",
        help="the largest request body, e.g. 64KiB; a larger one is answered 413 before it is parsed",
    )
    parser.add_argument(
        "--max-prompt-tokens",
        type=count(1, "tokens"),
        help="the most tokens one prompt may have, 413 past it; below --max-model-len, which must leave room "
        "for a completion token (default: --max-model-len - 1)",
    )
    parser.add_argument(
        "--max-model-len",
        type=count(2, "tokens (a prompt token and a completion token at least)"),
        help="the most tokens a request may have, its prompt and max_tokens together (prompt + max_tokens "
        "<= this, as vLLM counts): each slot's room (default: the model's learned positions, else 4096)",
    )
    parser.add_argument(
        "--served-model-name",
        type=_model_name,
        metavar="NAME",
        help="the model's name in the API (default: the checkpoint folder's name)",
    )
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1/ (401 without it); visible to every user in `ps`: "
        "prefer $K3_API_KEY or --api-key-file (default: $K3_API_KEY, if set; else no key)",
    )
    parser.add_argument(
        "--api-key-file",
        metavar="PATH",
        help="as --api-key, the key read from a file (the whitespace around it dropped)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=number(0, "seconds"),
        default=30.0,
        help="seconds SIGTERM (or SIGHUP, Ctrl-C) waits for running requests before ending them (a stream's "
        'last chunk with finish_reason "abort", a whole answer a 503)',
    )
    parser.add_argument(
        "--request-timeout",
        type=number(0, "seconds", above=True),
        default=REQUEST_TIMEOUT,
        help="seconds a request's head and body have to arrive, from its first byte (or the connection's "
        "opening): past it the answer is 408 and the connection closes, so a client that trickles bytes "
        "holds no connection for long",
    )
    parser.add_argument(
        "--max-connections",
        type=count(1, "connections"),
        default=MAX_CONNECTIONS,
        help="connections open at once; a new one past it is answered 503 with Retry-After and closed (the "
        "process's open-file limit is raised to fit, where its hard limit allows)",
    )
    parser.add_argument("--threads", type=count(1, "torch threads"), help="torch threads (default: all cores)")
    parser.add_argument("--device", choices=DEVICES, default="auto", help="where the model runs")
    parser.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="info",
        help="uvicorn's log level",
    )


def _check_cache_memory(budget: int, text: str, device) -> None:
    """--cache-memory must fit the memory the device has now (the GPU's free memory, or the machine's)."""
    import torch

    from ..runtime import refuse_if_over_memory

    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        if budget > free:
            raise ValueError(
                f"--cache-memory {text}: {budget:,} bytes asked, more than the {free:,} bytes free on "
                f"{device}; give a smaller --cache-memory"
            )
        return
    refuse_if_over_memory(f"--cache-memory {text}", budget, "give a smaller --cache-memory")


FILE_MARGIN = 128  # open files kept beside --max-connections' sockets: the model's, the logs', torch's


def _fit_connections(n: int) -> None:
    """--max-connections sockets and FILE_MARGIN files more within the process's open-file limit: the soft
    limit raised to fit where the hard one allows (vLLM raises it alike), else a one-line refusal (past it
    a connection would be refused by the operating system, unanswered)."""
    try:
        import resource
    except ImportError:  # not a POSIX system: no such limit to fit
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = n + FILE_MARGIN
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise ValueError(
            f"--max-connections {n}: this process may open {hard:,} files at most (ulimit -Hn), and k3 serve "
            f"keeps {FILE_MARGIN} for its own: give at most --max-connections {max(1, hard - FILE_MARGIN)}, or "
            f"raise the hard limit"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


API_KEY_VARIABLE = "K3_API_KEY"  # the API key from the environment (vLLM reads VLLM_API_KEY alike)


def read_api_key(args) -> str | None:
    """The API key k3 serve requires: from --api-key-file (its text, less the whitespace around it),
    --api-key (visible to every user in `ps`) or $K3_API_KEY, in that order; None without any. Checked
    (`k3.serve.gate.check_api_key`), each error naming where the key came from. OPENAI_API_KEY is not read:
    it is the key a client sends to OpenAI, often set in the same shell."""
    from ..serve.gate import check_api_key

    if args.api_key is not None and args.api_key_file is not None:
        raise ValueError("--api-key and --api-key-file: give one of them (or neither, and $K3_API_KEY)")
    if args.api_key_file is not None:
        source = f"--api-key-file {args.api_key_file}"
        try:
            key = Path(args.api_key_file).read_text(encoding="utf-8").strip()
        except OSError as e:
            raise ValueError(f"{source}: cannot read it ({e.strerror or type(e).__name__})") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"{source}: not UTF-8 text (byte {e.start}); the file holds the key alone") from None
    elif args.api_key is not None:
        key, source = args.api_key, "--api-key"
    elif API_KEY_VARIABLE in os.environ:
        key, source = os.environ[API_KEY_VARIABLE], f"${API_KEY_VARIABLE}"
    else:
        return None
    return check_api_key(key, source)


def _check_prompt_tokens(max_prompt_tokens: int | None, max_model_len: int, default: bool) -> None:
    """--max-prompt-tokens below --max-model-len: a prompt and at least one completion token must fit (the
    model's length known before the model loads when --max-model-len is given, else once it is loaded)."""
    if max_prompt_tokens is not None and max_prompt_tokens >= max_model_len:
        given = f"--max-model-len {max_model_len}" + (" (its default for this model)" if default else "")
        raise ValueError(
            f"--max-prompt-tokens {max_prompt_tokens}: {given} leaves a prompt {max_model_len - 1} tokens at most "
            f"(a prompt and at least one completion token); give at most --max-prompt-tokens {max_model_len - 1}"
        )


def run(args) -> int:
    """`k3 serve`: the checkpoint behind OpenAI's API (`k3.serve`); checked as `k3 generate` checks it. The
    flags are checked and --host:--port bound before the model loads (`k3.serve.bind`: a bad host or a busy
    port is one line at once, not uvicorn's error after a long load), and the socket is what uvicorn serves."""
    import torch

    from ..runtime import resolve_device
    from ..serve import bind, require_serve_extra

    require_serve_extra()
    api_key = read_api_key(args)
    budget = size_flag(args.cache_memory, "--cache-memory")
    max_request_bytes = size_flag(args.max_request_bytes, "--max-request-bytes")
    _fit_connections(args.max_connections)
    if args.max_model_len is not None:
        _check_prompt_tokens(args.max_prompt_tokens, args.max_model_len, default=False)
    if not Path(args.checkpoint).is_dir():
        raise FileNotFoundError(
            f"--checkpoint {args.checkpoint}: no such folder (expected a checkpoint folder, "
            f"e.g. what k3 train --out wrote)"
        )
    use_threads(args)
    threads = torch.get_num_threads()  # the engine's; this thread loads on one (see k3.serve.engine)
    torch.set_num_threads(1)
    device = resolve_device(args.device)
    _check_cache_memory(budget, args.cache_memory, device)
    sockets = bind(args.host, args.port)
    try:
        _load_and_serve(args, sockets, device, budget, api_key, max_request_bytes, threads)
    finally:
        for sock in sockets:
            sock.close()
    return 0


def _load_and_serve(
    args, sockets, device, budget: int, api_key: str | None, max_request_bytes: int, threads: int
) -> None:
    """The checkpoint loaded (its chat template checked before the model), the engine and the app made, then
    served on `sockets` until a signal stops it (`k3.serve.serve`)."""
    from ..io import reading
    from ..models import CausalLM
    from ..serve import Engine, build_app, serve
    from ..serve.text import load_chat_template, special_tokens
    from ..tokenizer import Tokenizer
    from .preflight import check_checkpoint

    with reading(args.checkpoint):  # one whole save, read under the folder's lock (k3.io.reading)
        check_checkpoint(args.checkpoint, f"--checkpoint {args.checkpoint}")
        chat_template = load_chat_template(args.checkpoint)  # checked (a damaged file named) before the model
        special = special_tokens(args.checkpoint)
        tokenizer = Tokenizer.load(args.checkpoint)
        model = CausalLM.from_pretrained(args.checkpoint).to(device).eval()
    positions = model.config.max_position_embeddings
    if positions and args.max_model_len and args.max_model_len > positions:
        raise ValueError(
            f"--max-model-len {args.max_model_len}: {model.config.name!r} has learned positions for {positions} "
            f"tokens only"
        )
    name = args.served_model_name or Path(args.checkpoint).resolve().name
    try:
        engine = Engine(
            model,
            budget,
            max_queue=args.max_queue,
            max_running=args.max_running,
            max_length=args.max_model_len,  # default: the model's positions, else DEFAULT_MAX_LENGTH
            prefill_chunk=args.prefill_chunk,
            max_num_batched_tokens=args.max_num_batched_tokens,
            compile=args.compile,
            prefix_cache=args.prefix_cache,
            threads=threads,
        )
    except ValueError as e:
        raise ValueError(f"--cache-memory {args.cache_memory}: {e}") from None
    _check_prompt_tokens(args.max_prompt_tokens, engine.max_length, default=args.max_model_len is None)
    app = build_app(
        engine,
        tokenizer,
        name,
        chat_template=chat_template,
        special=special,
        max_model_len=engine.max_length,
        api_key=api_key,
        max_request_bytes=max_request_bytes,
        max_prompt_tokens=args.max_prompt_tokens,
        stream_interval=args.stream_interval,
    )

    compiling = f"eager steps, {len(engine.pool.batch_buckets())} batch sizes compiling in the background (/health)"
    steps = compiling if engine.pool.compile else "eager steps"

    def ready(port: int) -> None:
        print(
            f"k3 serve: {name!r} ({model.config.name}, {model.num_parameters():,} parameters, on {device}); "
            f"cache budget {budget:,} bytes: {engine.slots} slots of {engine.max_length:,} tokens "
            f"({engine.pool_bytes:,} bytes); prefill chunk {args.prefill_chunk or 'off'}; prefix cache "
            f"{'on' if engine.prefix is not None else 'off'}; {steps}; http://{args.host}:{port}/v1",
            file=sys.stderr,
            flush=True,
        )

    serve(
        app,
        engine,
        host=args.host,
        port=args.port,
        shutdown_timeout=args.shutdown_timeout,
        log_level=args.log_level,
        on_ready=ready,
        request_timeout=args.request_timeout,
        max_connections=args.max_connections,
        sockets=sockets,
    )
