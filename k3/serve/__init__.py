"""`k3 serve`: a checkpoint behind OpenAI's HTTP API, with continuous batching (needs k3[serve]).

    k3 serve --checkpoint runs/demo --cache-memory 1GiB
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "demo", "prompt": "ROMEO:", "max_tokens": 40}'

- `k3.serve.engine`: one loop that decodes every running sequence together, admits new ones as the cache
  budget allows and drops finished ones (`Engine`, `Sequence`);
- `k3.serve.api`: the FastAPI app, /v1/completions, /v1/chat/completions (streaming as server-sent
  events), /v1/models, /health (`build_app`); `k3.serve.gate`: OpenAI's error answers and the ASGI gate
  before the app (API key, body size); `k3.serve.jobs`: a request's sequences as the app awaits them;
  `k3.serve.protocol`: the request bodies, checked;
- `k3.serve.text`: streaming detokenization, stop strings, chat prompts.

`serve` runs the app under uvicorn. SIGTERM (or Ctrl-C) stops admitting: the server still listens and
answers a new request 503 with Retry-After while the running requests finish, for up to `shutdown_timeout`
seconds; then it stops listening, cancels what is left and returns (exit 0). A second signal exits at once.
"""

from __future__ import annotations

import re
import signal
import threading
import time

from .engine import Draining, Engine, QueueFull, Sequence, prefill_bytes, sequence_bytes

__all__ = [
    "Draining",
    "Engine",
    "QueueFull",
    "Sequence",
    "build_app",
    "parse_bytes",
    "prefill_bytes",
    "sequence_bytes",
    "serve",
    "ServerThread",
]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "t": 10**12,
    "tb": 10**12,
}


def parse_bytes(text: str) -> int:
    """'512MiB', '2GB', '1.5 GiB' or a plain number of bytes -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"expected a size such as 512MiB, 2GB or 1000000 (bytes), got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def build_app(*args, **kwargs):
    """`k3.serve.api.build_app` (imported on use: FastAPI is the optional extra k3[serve])."""
    from .api import build_app as build

    return build(*args, **kwargs)


def require_serve_extra(what: str = "k3 serve") -> None:
    """A clear error when FastAPI or uvicorn is missing."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ValueError(
            f"{what} needs the optional extra k3[serve] (FastAPI and uvicorn), which is not installed "
            f"({e.name} is missing): pip install 'k3[serve]'"
        ) from None


def _server(app, engine: Engine, host: str, port: int, shutdown_timeout: float, log_level: str, on_ready=None):
    """A uvicorn server for `app` that stops `engine` admitting when told to exit."""
    import uvicorn

    class Server(uvicorn.Server):
        draining_since: float | None = None

        def handle_exit(self, sig, frame):
            """The first signal drains: the engine admits nothing new (a new request gets 503 with
            Retry-After, /health says "draining") while the socket still listens; `on_tick` ends the server
            once nothing runs or `shutdown_timeout` has passed. A second signal exits now."""
            if self.draining_since is None and not self.should_exit:
                self._captured_signals.append(sig)
                engine.drain()
                self.draining_since = time.monotonic()
            else:
                super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            if await super().on_tick(counter):
                return True
            if self.draining_since is None:
                return False
            stats = engine.stats()
            if stats["running"] == 0 and stats["waiting"] == 0:
                return True
            if time.monotonic() - self.draining_since > shutdown_timeout:
                engine.stop(timeout=0)  # cancel what is left: its clients get what they have so far
                return True
            return False

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if on_ready is not None and self.servers:
                on_ready(self.servers[0].sockets[0].getsockname()[1])

    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout, access_log=False
    )
    return Server(config)


def serve(
    app,
    engine: Engine,
    host: str = "127.0.0.1",
    port: int = 8000,
    shutdown_timeout: float = 30.0,
    log_level: str = "info",
    on_ready=None,
) -> None:
    """Run `app` under uvicorn until SIGTERM or Ctrl-C (see the module docstring). `on_ready(port)` is
    called once the socket listens (the port uvicorn bound: useful with port=0)."""
    server = _server(app, engine, host, port, shutdown_timeout, log_level, on_ready)
    # uvicorn re-raises the signal it stopped on once it is done, to the handler that was there before: a
    # handler that does nothing lets SIGTERM end the process with exit code 0
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: None) if main else None
    try:
        server.run()
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
        engine.stop(timeout=10)


class ServerThread:
    """`app` served on a thread of this process (a notebook, a test, a benchmark): `url` once started,
    `stop()` shuts it down as SIGTERM would. A context manager."""

    def __init__(
        self,
        app,
        engine: Engine,
        host: str = "127.0.0.1",
        port: int = 0,
        shutdown_timeout: float = 5.0,
        log_level: str = "warning",
    ):
        ready = threading.Event()
        self.port: int | None = None

        def on_ready(bound: int) -> None:
            self.port = bound
            ready.set()

        self.engine = engine
        self._server = _server(app, engine, host, port, shutdown_timeout, log_level, on_ready)
        self._thread = threading.Thread(target=self._server.run, name="k3-serve", daemon=True)
        self._thread.start()
        while not ready.wait(0.05):
            if not self._thread.is_alive():
                raise RuntimeError(f"k3 serve: the server did not start on {host}:{port}")
        self.url = f"http://{host}:{self.port}"

    def stop(self) -> None:
        self.engine.drain()
        self._server.should_exit = True
        self._thread.join(30)
        self.engine.stop(timeout=10)

    def __enter__(self) -> "ServerThread":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
