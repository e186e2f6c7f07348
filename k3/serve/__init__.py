"""`k3 serve`: a checkpoint behind OpenAI's HTTP API, with continuous batching (needs k3[serve]).

    k3 serve --checkpoint runs/demo --cache-memory 1GiB
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "demo", "prompt": "ROMEO:", "max_tokens": 40}'

- `k3.serve.engine`: one loop that decodes every running sequence together, admits new ones as the cache
  budget allows and drops finished ones (`Engine`, `Sequence`);
- `k3.serve.api`: the FastAPI app, /v1/completions, /v1/chat/completions (streaming as server-sent
  events), /v1/models, /health (`build_app`); `k3.serve.gate`: OpenAI's error answers, the ASGI gate
  before the app (API key, body size) and the connections' guard (a deadline to arrive, a bound on how
  many); `k3.serve.jobs`: a request's sequences as the app awaits them;
  `k3.serve.protocol`: the request bodies, checked;
- `k3.serve.text`: streaming detokenization, stop strings, chat prompts.

`serve` runs the app under uvicorn. SIGTERM, SIGHUP (a closed terminal) or Ctrl-C stops admitting: the
server still listens and answers a new request 503 with Retry-After while the running requests finish, for
up to `shutdown_timeout` seconds; then, or at a second signal, it stops listening and ends what is left
cleanly: a stream gets a last chunk with finish_reason "abort" (vLLM's, for a request it stopped) and
`data: [DONE]`, a request waiting for its whole answer a 503 in OpenAI's error shape; then it returns
(exit 0). A third signal exits as uvicorn would. A request's head and body must arrive within
`request_timeout` seconds of its first byte (408 and the connection closed past it), and at most
`max_connections` connections are open (a new one past it is answered 503): `k3.serve.gate.guarded`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import re
import signal
import socket
import threading
import time

from .engine import Draining, Engine, QueueFull, Sequence, prefill_bytes, sequence_bytes

__all__ = [
    "Draining",
    "Engine",
    "MAX_CONNECTIONS",
    "QueueFull",
    "REQUEST_TIMEOUT",
    "Sequence",
    "bind",
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
    """'512MiB', '2GB', '1.5 GiB' or a plain number of bytes -> bytes: a whole number of them, at least 1
    ('0.5' or '0.1KiB' is refused, not rounded down to a smaller size, or to none at all)."""
    from fractions import Fraction

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"expected a size such as 512MiB, 2GB or 1000000 (bytes), got {text!r}")
    size = Fraction(match.group(1)) * _UNITS[match.group(2).lower()]  # exact: 1.5GiB is 1,610,612,736 bytes
    if size < 1 or size.denominator != 1:
        raise ValueError(
            f"expected a whole number of bytes, at least 1, such as 512MiB, 2GB or 1000000, got {text!r} "
            f"({float(size):g} bytes)"
        )
    return int(size)


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


def bind(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to `host`:`port` as uvicorn would bind them (asyncio's create_server: every address the
    host resolves to, IPv6 ones IPv6-only, SO_REUSEADDR), not yet listening, for `serve` to serve on: k3 serve
    binds before it loads the model, so a host that is no address of this machine or a port in use is a
    one-line ValueError naming --host or --port at once, not uvicorn's unnamed error after the load."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        reason = e.strerror if isinstance(e, socket.gaierror) else str(e)
        raise ValueError(f"--host {host}: not an address, nor a name that resolves ({reason})") from None
    sockets: list[socket.socket] = []
    unavailable = None
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:  # every address on the one free port the first was given
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            try:
                sock.bind(address)
            except OSError as e:
                if e.errno != errno.EADDRNOTAVAIL:
                    raise
                unavailable = e  # an address family this machine lacks (asyncio skips it alike)
                sockets.pop().close()
        if not sockets:
            raise unavailable or OSError(errno.EADDRNOTAVAIL, "no address to bind")
    except OSError as e:
        for sock in sockets:
            sock.close()
        raise ValueError(_bind_error(host, port, e)) from None
    return sockets


def _bind_error(host: str, port: int, e: OSError) -> str:
    reason = e.strerror or str(e)
    if e.errno == errno.EADDRINUSE:
        return f"--port {port}: already in use on {host} ({reason}); give another port, or 0 for any free one"
    if e.errno == errno.EACCES:
        return f"--port {port}: not allowed here ({reason}; ports below 1024 need privileges); give 1024 or above"
    if e.errno == errno.EADDRNOTAVAIL:
        return f"--host {host}: not an address of this machine ({reason}); give one of its own, or 0.0.0.0 for all"
    return f"--host {host} --port {port}: cannot bind ({reason})"


REQUEST_TIMEOUT = 30.0  # seconds a request's head and body have to arrive (k3 serve --request-timeout)
MAX_CONNECTIONS = 1024  # connections open at once (k3 serve --max-connections)
GRACE = 5.0  # seconds a stopping server gives its last requests to send their ends before it closes them

# the signals that stop a server: SIGTERM, Ctrl-C and SIGHUP (its terminal closed), each drained alike
SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, name))


def _server(
    app,
    engine: Engine,
    host: str,
    port: int,
    shutdown_timeout: float,
    log_level: str,
    on_ready=None,
    request_timeout: float = REQUEST_TIMEOUT,
    max_connections: int = MAX_CONNECTIONS,
):
    """A uvicorn server for `app` that drains `engine` when told to exit (see the module docstring), over
    `k3.serve.gate.guarded`'s protocol: a request's deadline to arrive, a bound on connections."""
    import uvicorn

    from .gate import guarded

    protocol = guarded(request_timeout, max_connections)

    # the app's own way to end every request now (`build_app`'s); another ASGI app relies on the engine
    abort_requests = getattr(getattr(app, "state", None), "abort_requests", None)

    class Server(uvicorn.Server):
        draining_since: float | None = None
        abort_now = False

        def handle_exit(self, sig, frame):
            """The first signal drains: the engine admits nothing new (a new request gets 503 with
            Retry-After, /health says "draining") while the socket still listens, until nothing runs or
            `shutdown_timeout` has passed. The second ends the running requests now. A third exits as
            uvicorn would (a fourth Ctrl-C without waiting for anything)."""
            if self.draining_since is None and not self.should_exit:
                self._captured_signals.append(sig)
                engine.drain()
                self.draining_since = time.monotonic()
            elif not self.abort_now:
                self.abort_now = True
            else:
                super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            """uvicorn's SIGTERM and SIGINT handlers, and SIGHUP's alike (else a closed terminal kills the
            server mid-answer)."""
            hup = getattr(signal, "SIGHUP", None)
            if hup is None or threading.current_thread() is not threading.main_thread():
                with super().capture_signals():
                    yield
                return
            with super().capture_signals():  # which re-raises the signals it stopped on, once all is restored
                previous = signal.signal(hup, self.handle_exit)
                try:
                    yield
                finally:
                    signal.signal(hup, previous)

        async def on_tick(self, counter: int) -> bool:
            if await super().on_tick(counter):
                return True
            if self.draining_since is None:
                return False
            stats = engine.stats()
            if stats["running"] == 0 and stats["waiting"] == 0:
                return True
            return self.abort_now or time.monotonic() - self.draining_since > shutdown_timeout

        def abort(self) -> None:
            """End what still runs: each request's last words (on this event loop), the engine's sequences."""
            if abort_requests is not None:
                abort_requests()
            engine.stop(timeout=0)

        async def shutdown(self, sockets=None):
            """Stop listening, end the requests still running (a stream's last chunk with finish_reason
            "abort" and `data: [DONE]`, a whole answer's 503), give them GRACE seconds to be sent, then
            close the connections still open, so that no request is cancelled mid-answer (uvicorn's
            traceback, a client's "response ended prematurely"); then uvicorn's own shutdown."""
            for server in self.servers:
                server.close()
            self.abort()
            deadline = time.monotonic() + GRACE
            while self.server_state.tasks and time.monotonic() < deadline and not self.force_exit:
                await asyncio.sleep(0.02)
            for connection in list(self.server_state.connections):
                connection.transport.close()  # a request still reading its body sees its client go
            await super().shutdown(sockets)

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if on_ready is not None and self.servers:
                on_ready(self.servers[0].sockets[0].getsockname()[1])

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol,
        log_level=log_level,
        timeout_graceful_shutdown=GRACE,
        access_log=False,
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
    request_timeout: float = REQUEST_TIMEOUT,
    max_connections: int = MAX_CONNECTIONS,
    sockets: list[socket.socket] | None = None,
) -> None:
    """Run `app` under uvicorn until SIGTERM, SIGHUP or Ctrl-C (see the module docstring). `on_ready(port)`
    is called once the socket listens (the port uvicorn bound: useful with port=0); `request_timeout`:
    seconds a request's head and body have to arrive (408 past it); `max_connections`: connections open
    at once (a new one past it is answered 503); `sockets`: `bind`'s, served instead of binding
    `host`:`port` now."""
    server = _server(app, engine, host, port, shutdown_timeout, log_level, on_ready, request_timeout, max_connections)
    # uvicorn re-raises the signal it stopped on once it is done, to the handler that was there before: a
    # handler that does nothing lets SIGTERM (or SIGHUP) end the process with exit code 0
    main = threading.current_thread() is threading.main_thread()
    quiet = [s for s in SIGNALS if s != signal.SIGINT] if main else []
    previous = {s: signal.signal(s, lambda *_: None) for s in quiet}
    try:
        server.run(sockets=sockets)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
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
        request_timeout: float = REQUEST_TIMEOUT,
        max_connections: int = MAX_CONNECTIONS,
    ):
        ready = threading.Event()
        self.port: int | None = None

        def on_ready(bound: int) -> None:
            self.port = bound
            ready.set()

        self.engine, self.shutdown_timeout = engine, shutdown_timeout
        self._server = _server(
            app, engine, host, port, shutdown_timeout, log_level, on_ready, request_timeout, max_connections
        )
        self._thread = threading.Thread(target=self._server.run, name="k3-serve", daemon=True)
        self._thread.start()
        while not ready.wait(0.05):
            if not self._thread.is_alive():
                raise RuntimeError(f"k3 serve: the server did not start on {host}:{port}")
        self.url = f"http://{host}:{self.port}"

    def stop(self) -> None:
        """Stop as SIGTERM stops `k3 serve`: drain for up to `shutdown_timeout`, then end what runs."""
        self._server.handle_exit(signal.SIGTERM, None)
        self._thread.join(self.shutdown_timeout + 2 * GRACE + 30)
        self.engine.stop(timeout=10)

    def __enter__(self) -> "ServerThread":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
