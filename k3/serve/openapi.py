"""`k3 serve`'s OpenAPI schema (/openapi.json) as the server answers: FastAPI documents a 200 and its own 422, but
k3 answers a refused request 400 (OpenAI's status for a bad request), and 401, 404, 408, 413, 415, 503 or 500 in
OpenAI's error shape; a streamed answer is `text/event-stream`. `document(app, max_model_len, vocab_size)` replaces the
generated schema's responses with those, bounds `max_tokens` by the server's length and token ids by the model's
vocabulary, so a client generated from the schema (or a schema fuzzer) knows every status and every limit it
will meet."""

from __future__ import annotations

from fastapi.openapi.utils import get_openapi

ERROR = {  # OpenAI's error body: {"error": {"message", "type", "param", "code"}}
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["integer", "string", "null"]},
            },
        }
    },
}

# why each status is answered (every route may meet the gate's and the server's)
STATUSES = {
    "400": "a field out of range, of the wrong type, or a setting that would do nothing (the field is `param`)",
    "401": "no valid API key (k3 serve --api-key / $K3_API_KEY / --api-key-file)",
    "404": "a model this server does not serve, or an unknown path",
    "405": "a method the path does not take",
    "408": "the request's head or body did not arrive within --request-timeout",
    "413": "a body larger than --max-request-bytes, or a prompt past --max-prompt-tokens",
    "415": "a body not sent as JSON, or compressed (Content-Encoding)",
    "500": "the server failed",
    "503": "busy (the queue is full; Retry-After) or stopping",
}
POST_ONLY = ("400", "408", "413", "415")  # statuses only a request with a body meets

# one server-sent event of a stream: `data:` a JSON chunk, then the last `data: [DONE]`
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}

# the rules between fields that k3's checks hold (k3.serve.protocol), as JSON Schema: stream_options only
# with "stream": true; a chat's top_logprobs only with "logprobs": true
STREAM_OPTIONS_NEED_STREAM = {
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
}
TOP_LOGPROBS_NEED_LOGPROBS = {
    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
}


def _responses(operation: dict, post: bool, stream: bool, keyed: bool) -> dict:
    ok = operation.get("responses", {}).get("200", {"description": "Successful Response"})
    if stream:  # "stream": true answers server-sent events
        ok.setdefault("content", {})["text/event-stream"] = {"schema": SSE_EVENT}
    out = {"200": ok}
    for status, why in STATUSES.items():
        if (post or status not in POST_ONLY) and (keyed or status != "401"):
            out[status] = {
                "description": why,
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
            }
    return out


def document(app, max_model_len: int, vocab_size: int, model_name: str | None = None) -> None:
    """Give `app` (build_app's FastAPI app) the schema described in the module docstring; `model_name`, the
    served model's, is the example of /v1/models/{model}'s parameter."""

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components["Error"] = ERROR
        for name in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422, which k3 never answers
            components.pop(name, None)
        for path, operations in schema.get("paths", {}).items():
            for method, operation in operations.items():
                post = method == "post"
                stream = post and path.endswith("completions")
                operation["responses"] = _responses(operation, post, stream, path.startswith("/v1/"))
                for parameter in operation.get("parameters", []):
                    if parameter.get("name") == "model" and model_name is not None:
                        parameter["example"] = model_name
        for name in ("CompletionRequest", "ChatRequest"):
            request = components.get(name, {})
            for field in ("max_tokens", "max_completion_tokens"):
                _bound(request.get("properties", {}).get(field), max_model_len - 1)
            chat = [TOP_LOGPROBS_NEED_LOGPROBS] if name == "ChatRequest" else []
            request["allOf"] = [STREAM_OPTIONS_NEED_STREAM, *chat]
        for member in components.get("CompletionRequest", {}).get("properties", {}).get("prompt", {}).get("anyOf", []):
            ids = member.get("items", {})
            ids = ids.get("items", ids)  # a list of token ids, or a list of them
            if ids.get("type") == "integer":
                ids["maximum"] = vocab_size - 1
        app.openapi_schema = schema
        return schema

    app.openapi = openapi


def _bound(field: dict | None, most: int) -> None:
    """`maximum: most` on an integer field (or the integer member of its anyOf with null)."""
    if field is None:
        return
    for member in field.get("anyOf", [field]):
        if member.get("type") == "integer":
            member["maximum"] = most
