"""OpenAI's error answers (`APIError`, raised by the endpoints; `error_response`: the body
`{"error": {"message", "type", "param", "code"}}`) and `Gate`, the ASGI middleware before the app that
refuses a request without the API key, with a body too big or not UTF-8, before any of it is parsed."""

from __future__ import annotations

from fastapi.responses import JSONResponse

MAX_REQUEST_BYTES = 2**20  # a request body's default bound (k3 serve --max-request-bytes)


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
    return JSONResponse(error_body(message, kind, param, status), status, headers=headers)


def _printable(text: str | None) -> str | None:
    """`text` with a lone surrogate (from a request: JSON can spell one) written as its escape, so the
    answer that names it can be encoded as UTF-8."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


class Gate:
    """ASGI middleware before the app: the API key on /v1/ (401), a POST body no longer than
    `max_request_bytes` (413, by its Content-Length or as it is read: before any of it is parsed), and
    UTF-8 (400, not the JSON parser's unnamed failure). The body is read here and handed on unchanged;
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
        if self.api_key is not None and scope["path"].startswith("/v1/"):
            headers = dict(scope.get("headers") or [])
            if headers.get(b"authorization", b"").decode("latin-1") != f"Bearer {self.api_key}":
                response = error_response(
                    401,
                    "a valid API key is needed: header 'Authorization: Bearer KEY' (k3 serve --api-key)",
                    None,
                    "authentication_error",
                )
                return await response(scope, receive, send)
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
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
