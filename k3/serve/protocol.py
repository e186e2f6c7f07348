"""The request bodies `k3 serve` accepts: OpenAI's /v1/completions and /v1/chat/completions fields that
k3 implements, each checked by pydantic. A field OpenAI defines but k3 does not implement (logprobs,
penalties, tools, ...) is refused by name rather than ignored; `ignore_eos` is vLLM's extension (generate
past the end-of-text token: fixed output lengths for load tests)."""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk (load tests count tokens with it)


class Sampling(BaseModel):
    """What both endpoints share."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(default=None, gt=0)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=1)  # vLLM's extension
    n: int = Field(default=1, ge=1, le=16)
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(Sampling):
    # a text, several texts, a list of token ids, or several lists of token ids
    prompt: Union[str, list[str], list[int], list[list[int]]]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, gt=0)  # OpenAI's newer name for max_tokens
