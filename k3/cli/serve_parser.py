"""`k3 serve`'s checked arguments (`k3.cli.parser` adds the subcommand to `k3`'s parser)."""

from __future__ import annotations

import argparse

from ..runtime import DEVICES
from ..serve import MAX_CONNECTIONS, REQUEST_TIMEOUT
from ..serve.engine import PREFILL_CHUNK, PREFIX_CACHE
from .argtypes import _count, _number
from .serve_command import _serve

# the smallest prefill chunk taken (0 aside): each chunk is one forward, and with the prefix cache one block
# (k3.serve.prefix), which keeps every recurrent layer's state at its end; below this a turn's fixed cost
# dominates (kimi-k3-tiny on CPU, a 1,201-token prompt: 0.13 s at 512, 0.26 s at 64, 0.86 s at 16, 15 s at
# 1) and a prompt's blocks multiply. The engine shrinks a piece to fit its memory down to the same 64.
MIN_PREFILL_CHUNK = 64


def _prefill_chunk(text: str) -> int:
    """An argparse type: 0 (each prompt whole) or at least MIN_PREFILL_CHUNK tokens."""
    value = _count(0, "tokens")(text)
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


def add_serve_parser(sub) -> None:
    """`k3 serve`, added to the subparsers `sub` of `k3`'s parser."""
    srv = sub.add_parser(
        "serve",
        help="serve a checkpoint over OpenAI's HTTP API, continuous batching (k3[serve])",
        description="Serve a checkpoint over OpenAI's HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models, /health) with continuous batching. SIGTERM, SIGHUP or Ctrl-C "
        "stops admitting (new requests get 503 with Retry-After), lets running requests finish "
        "(--shutdown-timeout) and exits; then, or at a second signal, what still runs ends at once: a "
        'stream with finish_reason "abort" and data: [DONE], a whole answer with 503.',
    )
    srv.add_argument(
        "--checkpoint", required=True, metavar="DIR", help="a checkpoint folder (k3 train --out), as k3 generate reads"
    )
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    srv.add_argument("--port", type=_count(0, "a TCP port", high=65535), default=8000, help="port (0: any free one)")
    srv.add_argument(
        "--cache-memory",
        default="1GiB",
        metavar="SIZE",
        help="bytes of cache, e.g. 512MiB, at most the memory available: the slot pool (--max-running rows "
        "of --max-model-len tokens), the prompts being prefilled and their activations, and the prefix "
        "cache in what is left; a request is admitted when a slot is free and its prefill fits, else it waits",
    )
    srv.add_argument(
        "--max-queue",
        type=_count(1, "waiting requests"),
        default=256,
        help="sequences that may wait for room; past this, 503 with Retry-After",
    )
    srv.add_argument(
        "--max-running",
        type=_count(1, "sequences"),
        default=256,
        help="slots: sequences prefilled or decoded together at most (fewer when --cache-memory does not "
        "hold that many rows of --max-model-len tokens); more wait in the queue",
    )
    srv.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="decode with compiled steps over the slot pool, one graph per batch-size and length bucket "
        "(torch.compile: C++ kernels on the CPU, which need a C++ compiler; CUDA graphs on CUDA), compiled "
        "in the background while eager steps serve (every batch size's first, shorter lengths' as turns "
        "ask; /health counts them), kept in $TORCHINDUCTOR_CACHE_DIR (default ~/.cache/k3/inductor) for "
        "the next start (default: --no-compile, eager steps)",
    )
    srv.add_argument(
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
    srv.add_argument(
        "--max-num-batched-tokens",
        type=_count(1, "tokens"),
        default=None,
        help="tokens one engine turn's forward takes at most: one for each running sequence, then prompt pieces "
        "(at most --prefill-chunk) in what is left (vLLM's name; default: the running sequences and "
        "--prefill-chunk)",
    )
    srv.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=PREFIX_CACHE,
        help="keep prompts' states in blocks (--prefill-chunk tokens each; recurrent layers' states "
        "snapshotted at the block ends) and resume a prompt from its longest cached prefix: the same "
        "logits as computing it, in the cache budget's spare room "
        f"(default: {'--prefix-cache' if PREFIX_CACHE else '--no-prefix-cache'})",
    )
    srv.add_argument(
        "--stream-interval", type=_count(1, "tokens"), default=1, help="a streamed event every N tokens after the first"
    )
    srv.add_argument(
        "--max-request-bytes",
        default="1MiB",
        metavar="SIZE",
        help="the largest request body, e.g. 64KiB; a larger one is answered 413 before it is parsed",
    )
    srv.add_argument(
        "--max-prompt-tokens",
        type=_count(1, "tokens"),
        help="the most tokens one prompt may have, 413 past it; below --max-model-len, which must leave room "
        "for a completion token (default: --max-model-len - 1)",
    )
    srv.add_argument(
        "--max-model-len",
        type=_count(2, "tokens (a prompt token and a completion token at least)"),
        help="the most tokens a request may have, its prompt and max_tokens together (prompt + max_tokens "
        "<= this, as vLLM counts): each slot's room (default: the model's learned positions, else 4096)",
    )
    srv.add_argument(
        "--served-model-name",
        type=_model_name,
        metavar="NAME",
        help="the model's name in the API (default: the checkpoint folder's name)",
    )
    srv.add_argument(
        "--api-key",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1/ (401 without it); visible to every user in `ps`: "
        "prefer $K3_API_KEY or --api-key-file (default: $K3_API_KEY, if set; else no key)",
    )
    srv.add_argument(
        "--api-key-file",
        metavar="PATH",
        help="as --api-key, the key read from a file (the whitespace around it dropped)",
    )
    srv.add_argument(
        "--shutdown-timeout",
        type=_number(0, "seconds"),
        default=30.0,
        help="seconds SIGTERM (or SIGHUP, Ctrl-C) waits for running requests before ending them (a stream's "
        'last chunk with finish_reason "abort", a whole answer a 503)',
    )
    srv.add_argument(
        "--request-timeout",
        type=_number(0, "seconds", above=True),
        default=REQUEST_TIMEOUT,
        help="seconds a request's head and body have to arrive, from its first byte (or the connection's "
        "opening): past it the answer is 408 and the connection closes, so a client that trickles bytes "
        "holds no connection for long",
    )
    srv.add_argument(
        "--max-connections",
        type=_count(1, "connections"),
        default=MAX_CONNECTIONS,
        help="connections open at once; a new one past it is answered 503 with Retry-After and closed (the "
        "process's open-file limit is raised to fit, where its hard limit allows)",
    )
    srv.add_argument("--threads", type=_count(1, "torch threads"), help="torch threads (default: all cores)")
    srv.add_argument("--device", choices=DEVICES, default="auto", help="where the model runs")
    srv.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="info",
        help="uvicorn's log level",
    )
    srv.set_defaults(func=_serve)
