"""The HTTP side of `k3 serve`: OpenAI's API on FastAPI, over one `Engine`.

Endpoints: POST /v1/completions and /v1/chat/completions (JSON, or server-sent events with
`"stream": true`, ending in `data: [DONE]`), GET /v1/models and /health. Errors come as OpenAI's
`{"error": {"message", "type", "param", "code"}}`: 400 for a body that is not what the endpoint takes (the
message names the field; a body JSON cannot parse or JSON not an object; more sequences, prompts times n,
than the queue holds), 415 for a body not sent as JSON (Content-Type: application/json),
401 without the right key (`api_key`), 404 for another model's name, 413 for a
body over `max_request_bytes` (refused before it is parsed) or a prompt over `max_prompt_tokens`, 503 with
Retry-After while the queue is full or the server shuts down (and for a whole answer a stopping server cut
short: `abort_requests`; a stream cut short ends with finish_reason "abort" and `data: [DONE]`); 500
(`server_error`, and the traceback in the log) only for a failure of k3's own, such as the model raising
while it decodes that request, or the checkpoint's chat template failing on a conversation (its own
raise_exception(...) aside: that is the template refusing the conversation, 400 naming `messages`).

Prompts are tokenized on worker threads, without the GIL (k3's tokenizer releases it in `encode_batch`), a
long one (LONG_TEXT) on threads of the app's own, so that it holds up neither the event loop (/health,
streams) nor the short prompts of other requests; and a text whose length alone puts it past the prompt's
bounds (it has at least its bytes over the longest token's bytes in tokens) is refused before it is
tokenized at all.

A stream sends a choice's first token at once and then its text every `stream_interval` tokens (vLLM's
`--stream-interval`; 1 by default: every token), and what is left when it finishes: fewer, larger events
when many streams run, each event costing the server and its client a write and a parse.

Each choice of a request is one engine `Sequence`; its tokens reach the request's coroutine through an
asyncio queue (the engine runs on its own thread). A client that goes away, mid-stream or while waiting
for a whole answer, has its sequences cancelled at once, which frees their batch rows and their cache.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from .answers import Answer, stream_events
from .engine import Draining, Engine, QueueFull, Sequence
from .gate import MAX_REQUEST_BYTES, APIError, Gate, check_api_key, error_response
from .jobs import ClientGone, Job
from .openapi import document
from .protocol import ChatRequest, CompletionRequest, Sampling
from .text import PLAIN_STOPS, TemplateRefusal, TextStream, chat_prompt, compile_chat_template, longest_token_bytes

log = logging.getLogger("k3.serve")

COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
LONG_TEXT = 16 * 1024  # characters past which a text is tokenized on threads of its own (~30 ms of a core)
CHAT_TOKENS = 256  # k3's default for a chat reply (OpenAI: up to the context; a k3 model may have no limit)


# the tags pydantic puts in an error's location for a member of a union (str, list[int],
# function-after[...]): not fields, left out of `param`
_UNION_TAG = re.compile(r"^(str|int|float|bool|list\[.*\]|function-[a-z]+\[.*\])$")


def build_app(
    engine: Engine,
    tokenizer,
    model_name: str,
    *,
    chat_template: str | None = None,
    special: dict | None = None,
    max_model_len: int | None = None,
    api_key: str | None = None,
    max_request_bytes: int = MAX_REQUEST_BYTES,
    max_prompt_tokens: int | None = None,
    stream_interval: int = 1,
):
    """The FastAPI app serving `engine`'s model as `model_name`. The app starts the engine when it starts
    and stops it when it shuts down. `max_model_len`: the most tokens a sequence may have, its prompt and
    max_tokens together (prompt + tokens generated <= max_model_len, as vLLM counts; a `max_tokens` past what
    the prompt leaves is an upper bound, so the answer ends there, "length"; at most, and by default, the
    engine's `max_length`); `max_request_bytes`: the largest request body; `max_prompt_tokens`: the most
    tokens one prompt may have (413 past it; None: max_model_len - 1, which leaves one completion token;
    more is refused); `stream_interval`: the tokens a streamed event carries after the first (the last may
    carry fewer)."""
    if isinstance(stream_interval, bool) or not isinstance(stream_interval, int) or stream_interval < 1:
        raise ValueError(f"build_app: `stream_interval` must be an int >= 1 (tokens), got {stream_interval!r}")
    if not isinstance(model_name, str) or not model_name.strip():
        raise ValueError(f'build_app: `model_name` must be a name clients can send as "model", got {model_name!r}')
    if api_key is not None:
        check_api_key(api_key, "build_app: `api_key`")
    max_model_len = engine.max_length if max_model_len is None else min(max_model_len, engine.max_length)
    if max_prompt_tokens is not None and not 1 <= max_prompt_tokens < max_model_len:
        raise ValueError(
            f"build_app: `max_prompt_tokens` must be None or an int in [1, {max_model_len - 1}] (a prompt leaves "
            f"max_model_len {max_model_len} room for one completion token), got {max_prompt_tokens!r}"
        )
    template = None if chat_template is None else compile_chat_template(chat_template, "build_app: `chat_template`")
    longest = longest_token_bytes(tokenizer)  # None: no bound on a text's tokens from its length
    # k3's tokenizer (Hugging Face tokenizers) holds the GIL through `encode` but releases it in
    # `encode_batch`: with `encode`, a long prompt stalls every thread, the event loop's with it
    batch = getattr(tokenizer, "encode_batch", None)
    encode = tokenizer.encode if batch is None else (lambda text: batch([text])[0])
    # long texts are tokenized on threads of their own, half the cores: never all of asyncio's default
    # threads, which the short ones go on taking, and never every core, which the engine needs
    long_texts = ThreadPoolExecutor(max(1, _cores() // 2), thread_name_prefix="k3-tokenize")

    @asynccontextmanager
    async def lifespan(app):
        if engine._thread is None:
            engine.start()
        yield
        engine.stop(timeout=10)
        long_texts.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="k3 serve", lifespan=lifespan)
    app.add_middleware(Gate, api_key=api_key, max_request_bytes=max_request_bytes)
    created = int(time.time())
    jobs: weakref.WeakSet[Job] = weakref.WeakSet()  # the requests being answered (a stream never started: dropped)

    def abort_requests() -> None:
        """End every request being answered, now, on the event loop (a server that stops calls it): each
        unfinished choice finishes as "abort" (vLLM's reason for a request it stopped), so a stream sends
        its last chunk and `data: [DONE]` and a whole answer becomes a 503, whatever the engine's thread
        is doing; its sequences are cancelled."""
        for job in list(jobs):
            for index, reason in enumerate(job.reasons):
                if reason is None:
                    job.queue.put_nowait((index, "finish", "cancelled"))
            job.cancel(engine)

    app.state.abort_requests = abort_requests
    document(app, max_model_len, engine.model.config.vocab_size, model_name)

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return error_response(e.status, e.message, e.param, e.kind, e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):  # Starlette's own: an unknown path, a body json cannot parse
        return error_response(
            e.status_code,
            f"{request.method} {request.url.path}: {e.detail}",
            "body" if e.status_code == 400 else None,
            headers=getattr(e, "headers", None),
        )

    @app.exception_handler(Exception)
    async def bug(request, e: Exception):  # Starlette logs the traceback; the client gets JSON, not plain text
        return error_response(500, f"the server failed: {type(e).__name__}: {e}", None, "server_error")

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        whole = [err for err in e.errors() if tuple(err.get("loc", ())) == ("body",)]
        if whole and whole[0].get("type") in ("model_attributes_type", "dict_type"):  # not a JSON object
            return not_an_object(request.headers.get("content-type"), whole[0].get("input"))
        problems, param = [], None
        for err in e.errors():
            loc = [str(part) for part in err.get("loc", ())[1:] if not _UNION_TAG.match(str(part))]
            where = ".".join(loc)
            if err.get("type") == "json_invalid":
                where, err = "body", {"msg": f"not valid JSON ({err.get('ctx', {}).get('error', 'decode error')})"}
            param = param or where or "body"
            problems.append(f"{where or 'body'}: {str(err.get('msg')).removeprefix('Value error, ')}")  # ours
        return error_response(400, "; ".join(dict.fromkeys(problems)), param)

    def not_an_object(content_type: str | None, value) -> JSONResponse:
        """415 for a body sent as another type than JSON (FastAPI parses only JSON, so a form or text body
        reaches the model unparsed), 400 for JSON that is not an object; each naming what was sent."""
        media = (content_type or "").split(";")[0].strip().lower()
        if not (media == "application/json" or (media.startswith("application/") and media.endswith("+json"))):
            sent = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
            return error_response(
                415, f"body: sent with {sent}; send a JSON object with Content-Type: application/json", "body"
            )
        kind = {list: "array", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
        sent = kind.get(type(value), type(value).__name__)
        return error_response(400, f"body: a JSON {sent} was sent; the body must be a JSON object ({{...}})", "body")

    @app.get("/health")
    async def health():
        stats = engine.stats()
        return JSONResponse(
            {"status": "draining" if stats["draining"] else "ok", **stats}, 503 if stats["draining"] else 200
        )

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "k3"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):  # the openai client's models.retrieve
        if model != model_name:
            raise APIError(404, f"model: {model!r} is not served here; this server serves {model_name!r}", "model")
        return model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body)
        ids = body.prompt and isinstance(body.prompt[0], int)
        given = [body.prompt] if isinstance(body.prompt, str) or ids else body.prompt
        prompts = await completion_prompts(given, body.n)
        max_tokens = check_max_tokens(body.max_tokens, "max_tokens") or COMPLETION_TOKENS
        echo = [p if isinstance(p, str) else tokenizer.decode(p) for p in given] if body.echo else None
        asked = dict(logprobs=body.logprobs, prompt_logprobs=body.logprobs if body.echo else None, echo=echo)
        return await respond(request, body, prompts, max_tokens, body.stops(), chat=False, **asked)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        check_model(body)
        messages = [{"role": m.template_role(), "content": m.text()} for m in body.messages]
        try:
            text = chat_prompt(messages, template, special)
        except TemplateRefusal as e:  # the template's raise_exception(...): it refuses this conversation
            raise APIError(400, f"messages: {e}", "messages") from None
        except Exception as e:  # any other failure is the template's, the server's: not the client's to fix
            log.exception("k3 serve: the chat template failed on a conversation")
            message = f"the server's chat template failed on this conversation: {type(e).__name__}: {e}"
            raise APIError(500, message, None, "server_error") from None
        ids = await tokenize(text, "messages")
        check_prompt_tokens(len(ids), "messages")
        stops = body.stops() + ([] if chat_template is not None else PLAIN_STOPS)
        # both checked (each is a field of the schema); the newer name wins, as in vLLM
        newer, older = (check_max_tokens(getattr(body, name), name) for name in ("max_completion_tokens", "max_tokens"))
        max_tokens = newer or older
        if max_tokens is None:
            max_tokens = max(1, min(CHAT_TOKENS, max_model_len - len(ids)))
        asked = dict(logprobs=body.alternatives(), param="messages")
        return await respond(request, body, [ids], max_tokens, stops, chat=True, **asked)

    def check_model(body: Sampling) -> None:
        if body.model is not None and body.model != model_name:
            raise APIError(
                404,
                f"model: {body.model!r} is not served here; this server serves {model_name!r} (GET /v1/models)",
                "model",
                "invalid_request_error",
            )

    def check_prompt_tokens(tokens: int, param: str, counted: str = "") -> None:
        """A prompt within --max-prompt-tokens (413 past it); `counted`: how its `tokens` were counted, when
        that is a bound rather than its tokenization."""
        if max_prompt_tokens is not None and tokens > max_prompt_tokens:
            raise APIError(
                413,
                f"{param}: the prompt has {counted}{tokens} tokens, more than this server takes, "
                f"{max_prompt_tokens} (--max-prompt-tokens)",
                param,
            )

    def check_max_tokens(value: int | None, param: str) -> int | None:
        """A max_tokens within what /openapi.json states (max_model_len - 1: a prompt takes a token); within
        that, an upper bound (`respond` gives a sequence what its prompt leaves)."""
        if value is not None and value >= max_model_len:
            raise APIError(
                400,
                f"{param}: {value} tokens; this model takes {max_model_len} tokens at most, prompt and "
                f"completion together: ask for at most {max_model_len - 1}",
                param,
            )
        return value

    def check_model_len(tokens: int, param: str, counted: str = "") -> None:
        """A prompt must leave room for one completion token within max_model_len."""
        if tokens >= max_model_len:
            raise APIError(
                400,
                f"{param}: the prompt has {counted}{tokens} tokens; this model takes {max_model_len} tokens "
                f"at most, prompt and max_tokens together: a prompt of {max_model_len - 1} at most",
                param,
            )

    async def tokenize(text: str, param: str) -> list[int]:
        """`text`'s token ids. A text whose length alone puts it past the prompt's bounds (its tokens are at
        least its bytes over the longest token's) is refused before it is tokenized; another is tokenized on
        a worker thread, without the GIL (`encode`), a long one on the app's own threads, so that neither the
        event loop nor the other requests wait for it."""
        if longest is not None:
            size = len(text.encode("utf-8"))
            fewest, counted = -(-size // longest), f"{size:,} bytes of text ({longest} at most a token), so at least "
            check_prompt_tokens(fewest, param, counted)
            check_model_len(fewest, param, counted)
        long = len(text) > LONG_TEXT  # (characters: at most its bytes; its bytes are counted only with `longest`)
        return await asyncio.get_running_loop().run_in_executor(long_texts if long else None, encode, text)

    async def completion_prompts(prompt: list, n: int) -> list[list[int]]:
        if not prompt:
            raise APIError(400, "prompt: empty (give a text or a list of token ids)", "prompt")
        if len(prompt) * n > engine.max_queue:  # before any is tokenized: it could never be queued whole
            raise APIError(
                400,
                f"prompt: {len(prompt)} prompts x n = {n} are {len(prompt) * n} sequences; this "
                f"server queues at most {engine.max_queue} (--max-queue): send fewer at a time",
                "prompt",
            )
        out = []
        for p in prompt:
            ids = await tokenize(p, "prompt") if isinstance(p, str) else list(p)
            check_prompt_tokens(len(ids), "prompt")
            bad = [t for t in ids if not 0 <= t < engine.model.config.vocab_size]
            if bad:
                raise APIError(
                    400,
                    f"prompt: token id {bad[0]} is outside the model's vocabulary "
                    f"(0 ... {engine.model.config.vocab_size - 1})",
                    "prompt",
                )
            out.append(ids)
        return out

    async def respond(
        request,
        body: Sampling,
        prompts: list[list[int]],
        max_tokens: int,
        stops: list[str],
        chat: bool,
        param: str = "prompt",
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        echo: list[str] | None = None,
    ):
        for ids in prompts:
            if not ids:
                raise APIError(400, f"{param}: the prompt is empty after tokenization", param)
            check_model_len(len(ids), param)
        job = Job(asyncio.get_running_loop())
        eos = None if body.ignore_eos else tokenizer.eot_id
        for ids in prompts:
            for j in range(body.n):
                seed = None if body.seed is None else (body.seed + j) % 2**64
                try:
                    sequence = Sequence(
                        list(ids),
                        min(max_tokens, max_model_len - len(ids)),  # an upper bound: what the model's length leaves
                        body.temperature,
                        None if body.top_p >= 1 else body.top_p,
                        body.top_k,
                        seed,
                        eos,
                        presence_penalty=body.presence_penalty,
                        frequency_penalty=body.frequency_penalty,
                        logprobs=logprobs,
                        prompt_logprobs=prompt_logprobs,
                    )
                except ValueError as e:  # the protocol's checks come first: this is a second line
                    raise APIError(400, str(e), None) from None
                job.add(sequence, TextStream(tokenizer, stops))
        try:
            for sequence in job.sequences:
                engine.submit(sequence)
        except ValueError as e:  # the engine's own bounds: a slot's tokens, the prefill's memory
            job.cancel(engine)
            field = "max_tokens" if "max_tokens" in str(e) else "prompt" if "prefill" in str(e) else None
            raise APIError(400, f"{field}: {e}" if field else str(e), field) from None
        except (QueueFull, Draining) as e:
            job.cancel(engine)
            raise APIError(503, f"{e}; retry later", None, "server_busy", headers={"Retry-After": "1"}) from None
        jobs.add(job)
        prompt_tokens = sum(len(ids) for ids in prompts) * body.n
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        head = {
            "id": ident,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model_name,
        }
        echo = None if echo is None else [text for text in echo for _ in range(body.n)]  # a choice's prompt
        answer = Answer(tokenizer, chat, head, echo, logprobs is not None)
        if body.stream:
            options = body.stream_options
            usage = options is not None and (options.include_usage or options.continuous_usage_stats)
            running = options is not None and options.continuous_usage_stats

            async def events():
                try:
                    async for event in stream_events(
                        job, engine, answer, prompt_tokens, usage, running, stream_interval
                    ):
                        yield event
                finally:
                    jobs.discard(job)

            return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            texts = await job.collect(engine, request)
        except ClientGone:
            return JSONResponse({}, 499)
        finally:
            jobs.discard(job)
        if "abort" in job.reasons:
            raise APIError(
                503,
                "the server is shutting down and stopped this request before it finished; retry later",
                None,
                "server_busy",
                headers={"Retry-After": "1"},
            )
        for reason in job.reasons:
            if reason.startswith("error"):
                raise APIError(500, f"the model failed: {reason}", None, "server_error")
        return answer.whole(job, texts, prompt_tokens)

    return app


def _cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
