"""The request bodies `k3 serve` accepts: OpenAI's /v1/completions and /v1/chat/completions fields that k3
implements, each checked by pydantic as the request arrives, strictly (a number is not a string, a boolean is
not a number; 2.0 is the integer 2, as JSON Schema reads it) and against the rules the engine samples by
(`k3.inference.generation.check_sampling`; a seed taken mod 2**64), so a request the engine would fail on is
refused with 400 before it runs. Text fields refuse a lone surrogate ("\\ud800": JSON can spell it, UTF-8
cannot encode it); `stop` takes at most 16 strings (each is looked for after every token). A chat message's
content is a text or a list of text parts (as the openai client and guidellm send it); `developer` is a system
message. Logprobs (chat: `logprobs` and `top_logprobs`; completions: `logprobs` alternatives, with `echo` the
prompt's too) and the presence / frequency penalties are OpenAI's, computed in the engine's one draw a turn
(`k3.serve.sampler`). A field OpenAI defines but k3 does not implement (tools, logit_bias, ...) is refused
by name rather than ignored, and so is a setting that would do nothing or be overruled: an empty stop
string, stream_options without "stream": true, top_logprobs without logprobs. A chat's
max_completion_tokens (OpenAI's newer name) wins over max_tokens, as vLLM takes them. `ignore_eos` is vLLM's
extension (generate past the end-of-text token: fixed output lengths for load tests)."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from ..inference.generation import MAX_SEED, check_sampling
from .sequence import MAX_LOGPROBS


def _whole_unicode(text: str) -> str:
    """`text` if UTF-8 can encode it; a ValueError naming the first lone surrogate otherwise."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"a lone surrogate ({text[e.start]!r}) at character {e.start}: not Unicode text") from None
    return text


Text = Annotated[str, AfterValidator(_whole_unicode)]


def _integral(value):
    """A JSON number with no fraction (2.0) is the integer it spells, as JSON Schema's "integer" reads it;
    any other float, a string or a boolean stays what strict validation refuses."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def whole(**bounds):
    """An integer field with `bounds` (Field's), taking 2.0 as 2 (`_integral`); the bounds come first so the
    schema states them in JSON Schema's words (exclusiveMinimum, ...)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


# the schema says what the server's own checks refuse (an empty prompt, a negative id), for clients and schema
# fuzzers; the checks stay the server's, with their messages ("the prompt is empty", "... the vocabulary")
NonEmptyText = Annotated[Text, Field(json_schema_extra={"minLength": 1})]
TokenIds = Annotated[list[whole(json_schema_extra={"minimum": 0})], Field(json_schema_extra={"minItems": 1})]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk (load tests count tokens with it)


class Sampling(BaseModel):
    """What both endpoints share."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: Text | None = None
    max_tokens: whole(gt=0) | None = None
    temperature: float = Field(default=1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: whole(ge=1) | None = None  # vLLM's extension
    n: whole(ge=1, le=16) = 1
    stop: Union[NonEmptyText, Annotated[list[NonEmptyText], Field(max_length=16)], None] = None  # OpenAI: 4
    # choice j of n samples with seed + j, mod 2**64 as torch.Generator takes seeds (a larger seed too: JSON
    # clients and schemas hold integers past 2**53 as floats, so no exact upper bound can be stated)
    seed: whole(ge=0) | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    ignore_eos: bool = False
    presence_penalty: float = Field(default=0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2, allow_inf_nan=False)

    @field_validator("temperature", "top_p", "top_k")
    @classmethod
    def _sampling(cls, value, info):
        check_sampling(**{info.field_name: value})  # the ranges generate and the compiled step sample by
        return value

    @field_validator("seed")
    @classmethod
    def _seed(cls, value):
        return None if value is None else value % (MAX_SEED + 1)

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        stops = [value] if isinstance(value, str) else value or []
        if "" in stops:  # it would match everywhere, or (as it did) be dropped: either way not what was meant
            raise ValueError("an empty stop string; give stop strings of at least one character, or no stop")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, value, info):
        if value is not None and not info.data.get("stream"):  # OpenAI refuses it alike
            raise ValueError('stream_options is only allowed with "stream": true')
        return value

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(Sampling):
    logprobs: whole(ge=0, le=MAX_LOGPROBS) | None = None  # each token's logprob and this many alternatives
    echo: bool = False  # the prompt before the completion (and, with logprobs, its tokens' logprobs)
    # a text, several texts, a list of token ids, or several lists of token ids: none of them empty
    prompt: Union[
        NonEmptyText,
        Annotated[list[NonEmptyText], Field(json_schema_extra={"minItems": 1})],
        TokenIds,
        Annotated[list[TokenIds], Field(json_schema_extra={"minItems": 1})],
    ]


class TextPart(BaseModel):
    """One part of a message's content given as a list (OpenAI's content parts): k3 takes text parts."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: Text


class Message(BaseModel):
    """A chat message. `content`: a text, or a list of text parts, joined with newlines as vLLM joins them;
    the `developer` role (OpenAI's newer name for instructions) is a system message."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[Text, list[TextPart]]
    name: Text | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, value):
        if isinstance(value, list):
            for i, part in enumerate(value):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text" and isinstance(kind, str):
                    raise ValueError(
                        f"part {i} is of type {kind!r}: this model reads text only; send parts of type 'text'"
                    )
        return value

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)

    def template_role(self) -> str:
        return "system" if self.role == "developer" else self.role


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: whole(gt=0) | None = None  # OpenAI's newer name for max_tokens; it wins, as in vLLM
    logprobs: bool = False
    top_logprobs: whole(ge=0, le=MAX_LOGPROBS) | None = None  # alternatives per token (needs logprobs)

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, value, info):
        if value is not None and not info.data.get("logprobs"):  # OpenAI refuses it alike
            raise ValueError('top_logprobs is only allowed with "logprobs": true')
        return value

    def alternatives(self) -> int | None:
        """The engine's `logprobs`: None when not asked, else the alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None
