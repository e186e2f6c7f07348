"""OpenAI's error answers (`APIError`, raised by the endpoints; `error_response`: the body
`{"error": {"message", "type", "param", "code"}}`); `Gate`, the ASGI middleware before the app that
refuses a request without the API key, with a body too big or not UTF-8, before any of it is parsed; and
`guarded`, uvicorn's HTTP/1.1 protocol (h11) with a deadline for each request to arrive and a bound on the
connections open, which uvicorn has neither of (its keep-alive timeout runs only between requests)."""

from __future__ import annotations

import hmac
import json
import logging

import h11
from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_REQUEST_BYTES = 2**20  # a request body's default bound (k3 serve --max-request-bytes)
LINGER = 1.0  # seconds a refused connection is read (and dropped) after its answer, so it is not reset unread
LINGERING = 64  # refused connections lingering at most; one more is closed at once (a flood holds no more)
log = logging.getLogger("k3.serve")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers


def error_body(message: str, kind: str, param: str | None, code) -> dict:
    return {"error": {"message": _printable(message), "type": kind, "param": _printable(param), "code": code}}


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    kind: str = "invalid_request_error",
    headers: dict | None = None,
) -> JSONResponse:
    """The error answer; its reason also goes to the server's log (uvicorn's access line gives only the
    status), but for 503 "busy" answers, which a loaded server gives by the thousand and clients retry."""
    if status != 503:
        log.warning("refused (%d): %s", status, _printable(message))
    return JSONResponse(error_body(message, kind, param, status), status, headers=headers)


def check_api_key(key: str, source: str) -> str:
    """`key` if a client can send it as 'Authorization: Bearer KEY'; else a ValueError naming `source` (the
    flag, file or variable it came from) and why: blank, whitespace at either end (HTTP strips it from a
    header's value), or a character outside printable ASCII. The key itself is never repeated."""
    if not key.strip():
        raise ValueError(
            f"{source}: the API key is blank ({'empty' if not key else 'whitespace only'}), which no client can "
            f"send; give a key, or none to serve without one"
        )
    if key != key.strip():
        raise ValueError(
            f"{source}: the API key begins or ends with whitespace, which an HTTP header drops; no client could send it"
        )
    bad = next((i for i, c in enumerate(key) if not " " <= c <= "~"), None)
    if bad is not None:
        raise ValueError(
            f"{source}: the API key has {key[bad]!r} (character {bad}), not printable ASCII, which an "
            f"Authorization header does not carry alike from every client"
        )
    return key


def _bearer(header: str, key: str) -> bool:
    """Whether an Authorization header's value carries `key` as a bearer token: the scheme in any case
    ("bearer", "BEARER": RFC 7235 makes it case-insensitive), then one or more spaces and the key, compared
    in constant time."""
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.lstrip(" ").encode(), key.encode())


def _printable(text: str | None) -> str | None:
    """`text` with a lone surrogate (from a request: JSON can spell one) written as its escape, so the
    answer that names it can be encoded as UTF-8."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


class Gate:
    """ASGI middleware before the app: the API key on /v1/ (401), a POST body no longer than
    `max_request_bytes` (413, by its Content-Length or as it is read: before any of it is parsed), not
    compressed (415 for a Content-Encoding other than identity), and UTF-8 (400, not the JSON parser's
    unnamed failure). The body is read here and handed on unchanged;
    messages after it (a client's disconnect) pass straight through, so the app still sees a client go
    away."""

    def __init__(self, app, api_key: str | None = None, max_request_bytes: int = MAX_REQUEST_BYTES):
        self.app, self.api_key, self.max_request_bytes = app, api_key, max_request_bytes

    async def _too_big(self, scope, receive, send, size: str):
        response = error_response(
            413,
            f"body: {size}, more than this server takes, {self.max_request_bytes:,} bytes (--max-request-bytes)",
            "body",
        )
        await response(scope, receive, send)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        # a method no route takes (PUT, TRACE, ...) goes to the router's 405 (or 404) whatever the key: it
        # reaches nothing a key guards, and a client learns the method is wrong, not that it needs a key
        if self.api_key is not None and scope["path"].startswith("/v1/") and scope["method"] in ("GET", "HEAD", "POST"):
            if not _bearer(headers.get(b"authorization", b"").decode("latin-1"), self.api_key):
                response = error_response(
                    401,
                    "a valid API key is needed: header 'Authorization: Bearer KEY', the key this server "
                    "was given (k3 serve: $K3_API_KEY, --api-key-file or --api-key)",
                    None,
                    "authentication_error",
                )
                return await response(scope, receive, send)
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        encoding = headers.get(b"content-encoding", b"identity").decode("latin-1")
        if encoding.strip().lower() not in ("identity", ""):  # a compressed body would be read as its bytes
            response = error_response(
                415, f"body: sent with Content-Encoding {encoding!r}; this server takes the JSON uncompressed", "body"
            )
            return await response(scope, receive, send)
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_request_bytes:
            return await self._too_big(scope, receive, send, f"{int(length):,} bytes (Content-Length)")
        chunks, more, size = [], True, 0
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_request_bytes:
                return await self._too_big(scope, receive, send, f"{size:,} bytes and more")
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            response = error_response(400, f"body: not UTF-8 text (byte {e.start}); send JSON in UTF-8", "body")
            return await response(scope, receive, send)
        first = True

        async def replay():
            nonlocal first
            if first:
                first = False
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def guarded(request_timeout: float, max_connections: int) -> type:
    """uvicorn's h11 protocol (its `http=` class), guarded: a request's head and body must all arrive
    within `request_timeout` seconds of its first byte (of the connection's opening, for the first), else
    the answer is 408 and the connection closes (a client that opens connections and trickles bytes holds
    none for long); past `max_connections` open, a new connection is answered 503 with Retry-After and
    closed. Both answers are OpenAI's error body."""
    if not request_timeout > 0:
        raise ValueError(f"guarded: `request_timeout` must be > 0 seconds, got {request_timeout!r}")
    if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1:
        raise ValueError(f"guarded: `max_connections` must be an int >= 1, got {max_connections!r}")

    class Guarded(H11Protocol):
        deadline = None  # the timer of the request arriving now
        refused = False
        lingering = 0  # refused connections this server reads until they close (all of its connections')

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self.refused = True
                self._answer(
                    503,
                    f"this server has {max_connections} connections open, its bound (--max-connections); retry later",
                    None,
                    "server_busy",
                    {"Retry-After": "1"},
                )
                if Guarded.lingering < LINGERING and transport.can_write_eof():
                    transport.write_eof()  # the answer, then read what the client sent until it closes
                    Guarded.lingering += 1
                    self.loop.call_later(LINGER, self._end_linger)
                else:
                    transport.close()
                return
            self.deadline = self.loop.call_later(request_timeout, self._timed_out)

        def _end_linger(self) -> None:
            Guarded.lingering -= 1
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self.refused:
                return
            if self.deadline is None and self.conn.their_state is h11.IDLE:  # a kept-alive connection's next request
                self.deadline = self.loop.call_later(request_timeout, self._timed_out)
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE and self.conn.their_state is not h11.SEND_BODY:
                self._disarm()  # all of it is here (or the connection is done with)

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _disarm(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

        def _timed_out(self) -> None:
            self.deadline = None
            state = self.conn.their_state
            if self.transport.is_closing() or state not in (h11.IDLE, h11.SEND_BODY):
                return
            cycle = self.cycle if state is h11.SEND_BODY else None
            if cycle is None or not cycle.response_started:
                what = "body" if cycle is not None else "request head"
                self._answer(
                    408,
                    f"{what}: did not arrive within {request_timeout:g} s (--request-timeout); send the "
                    "whole request at once",
                    "body" if cycle is not None else None,
                )
            if cycle is not None:  # the app, waiting for the body, sees its client go
                cycle.disconnected = True
                cycle.message_event.set()
            self.transport.close()

        def _answer(self, status: int, message: str, param, kind="invalid_request_error", headers=None) -> None:
            """OpenAI's error body as a whole HTTP/1.1 answer, written straight to the socket (the app has
            not answered: no request arrived whole), the connection to be closed."""
            body = json.dumps(error_body(message, kind, param, status)).encode()
            phrase = {408: "Request Timeout", 503: "Service Unavailable"}[status]
            head = [f"HTTP/1.1 {status} {phrase}", "content-type: application/json", f"content-length: {len(body)}"]
            head += ["connection: close", *(f"{k}: {v}" for k, v in (headers or {}).items())]
            self.transport.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)

    return Guarded
