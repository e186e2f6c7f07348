"""`k3 serve`'s command: the checkpoint loaded and checked as `k3 generate` checks it, the flags that need
more than argparse (sizes, the cache budget against the memory there is, the API key's source, the
open-file limit for --max-connections), then `k3.serve.serve`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .argtypes import size_flag
from .commands import _use_threads


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


def _api_key(args) -> str | None:
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


def _serve(args) -> int:
    """`k3 serve`: the checkpoint behind OpenAI's API (`k3.serve`); checked as `k3 generate` checks it. The
    flags are checked and --host:--port bound before the model loads (`k3.serve.bind`: a bad host or a busy
    port is one line at once, not uvicorn's error after a long load), and the socket is what uvicorn serves."""
    import torch

    from ..runtime import resolve_device
    from ..serve import bind, require_serve_extra

    require_serve_extra()
    api_key = _api_key(args)
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
    _use_threads(args)
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
