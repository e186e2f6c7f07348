"""What `k3 serve` answers with: a request's choices in OpenAI's shapes, whole or as server-sent events.

An `Answer` knows the request's endpoint (chat or completion), its id and model, its prompts' text for
`echo`, and whether it asked for logprobs, and writes each choice from its engine `Sequence`:
- chat: `{"message": {...}}` or a chunk's `{"delta": {...}}`, logprobs as `{"content": [{"token", "logprob",
  "bytes", "top_logprobs": [...]}, ...]}`;
- completion: `{"text": ...}` (after the prompt with `echo`), logprobs as `{"tokens", "token_logprobs",
  "top_logprobs", "text_offset"}`, the prompt's tokens first with `echo` (the first one's logprob null: no
  token precedes it).
A token's text is its own decoding and `bytes` its exact bytes (a byte-level token may hold part of a
character), as OpenAI gives them.

`stream_events` sends a choice's first text at once and then every `stream_interval` tokens, and whatever
text has piled up for a choice as one event: a client slower than the engine gets fewer, larger events
rather than one per token (vLLM's `stream_interval` behaviour). A stream that fails mid-way sends an error
event and then `data: [DONE]`, as every stream ends.
"""

from __future__ import annotations

import json

from .gate import error_body
from .jobs import Job


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage, with the prompt tokens the prefix cache gave (`prompt_tokens_details.cached_tokens`)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def job_usage(job: Job, prompt_tokens: int) -> dict:
    return usage_of(prompt_tokens, sum(job.counts), sum(s.cached_tokens for s in job.sequences))


def _bytes_to_unicode() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): the printable character that stands for each byte, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


BYTE_OF = _bytes_to_unicode()


class TokenText:
    """A token id's text and exact bytes for logprobs (remembered: a response names the same tokens often)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.inner, self.known = tokenizer, getattr(tokenizer, "inner", None), {}
        added = getattr(self.inner, "get_added_tokens_decoder", None)  # id -> special or added token
        self.special = set(added()) if added is not None else set()

    def __call__(self, token: int) -> tuple[str, list[int]]:
        found = self.known.get(token)
        if found is None:
            text = self.tokenizer.decode([token])
            piece = self.inner.id_to_token(token) if self.inner is not None else None
            if piece is not None and token not in self.special and all(ch in BYTE_OF for ch in piece):
                raw = bytes(BYTE_OF[ch] for ch in piece)
            else:
                raw = text.encode("utf-8")
            found = self.known[token] = (text, list(raw))
        return found


class Answer:
    """One request's choices in OpenAI's shapes (see the module docstring). `head`: id, object, created,
    model; `echo`: each choice's prompt text to put first (completions), else None; `logprobs`: whether the
    request asked for them."""

    def __init__(self, tokenizer, chat: bool, head: dict, echo: list[str] | None = None, logprobs: bool = False):
        self.chat, self.head, self.echo, self.logprobs = chat, head, echo, logprobs
        self.token_text = TokenText(tokenizer)

    def whole(self, job: Job, texts: list[str], prompt_tokens: int) -> dict:
        choices = []
        for i, (sequence, text) in enumerate(zip(job.sequences, texts)):
            if self.chat:
                content = {"message": {"role": "assistant", "content": text}}
            else:
                content = {"text": (self.echo[i] if self.echo else "") + text}
            logprobs = self.choice_logprobs(sequence, 0, job.counts[i], prompt=bool(self.echo))
            choices.append({"index": i, **content, "logprobs": logprobs, "finish_reason": job.reasons[i]})
        return {**self.head, "choices": choices, "usage": job_usage(job, prompt_tokens)}

    def choice_logprobs(self, sequence, start: int, stop: int, prompt: bool = False) -> dict | None:
        """The logprobs of `sequence`'s tokens start ... stop-1 (with its prompt's first, `prompt`), or None
        when the request did not ask for them."""
        if not self.logprobs:
            return None
        entries = [(t, *e) for t, e in zip(sequence.tokens[start:stop], sequence.token_logprobs[start:stop])]
        if self.chat:
            return {"content": [self._chat_entry(*e) for e in entries], "refusal": None}
        if prompt:  # the prompt's first token has no logprob (nothing precedes it)
            first = [(sequence.prompt[0], None, None)]
            entries = first + [(t, *e) for t, e in zip(sequence.prompt[1:], sequence.prompt_token_logprobs)] + entries
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = 0
        for token, logprob, top in entries:
            text = self.token_text(token)[0]
            out["tokens"].append(text)
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append(None if top is None else {self.token_text(t)[0]: lp for t, lp in top})
            out["text_offset"].append(offset)
            offset += len(text)
        return out

    def _chat_entry(self, token: int, logprob: float, top: list[tuple[int, float]]) -> dict:
        text, raw = self.token_text(token)
        alternatives = []
        for t, lp in top:
            t_text, t_raw = self.token_text(t)
            alternatives.append({"token": t_text, "logprob": lp, "bytes": t_raw})
        return {"token": text, "logprob": logprob, "bytes": raw, "top_logprobs": alternatives}

    def chunk(self, index: int, text: str | None, reason: str | None, logprobs: dict | None = None, first=False):
        """One choice's server-sent event: its new text (None: no text, as a chat chunk that only ends)."""
        head = {**self.head, "object": "chat.completion.chunk" if self.chat else "text_completion"}
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
        return {**head, "choices": [choice]}


async def stream_events(job: Job, engine, answer: Answer, prompt_tokens: int, usage: bool, running: bool, interval):
    """The events of a streamed answer (see the module docstring); `usage`: a last chunk with the usage,
    `running`: the usage so far in every chunk (vLLM's continuous_usage_stats); `interval`: tokens per event
    after a choice's first."""

    def event(index: int, text: str | None, reason: str | None, logprobs=None, first: bool = False) -> str:
        chunk = answer.chunk(index, text, reason, logprobs, first)
        if running:
            chunk["usage"] = job_usage(job, prompt_tokens)
        return sse(chunk)

    try:
        n = len(job.sequences)
        if answer.chat:
            for i in range(n):
                yield event(i, None, None, first=True)
        # text held (with `echo`, the prompt's: it goes with the first event, its logprobs known by then)
        pending, sent, echoed = list(answer.echo or [""] * n), [0] * n, [not answer.echo] * n
        async for batch in job.batches(engine):  # what came since the last: one event a choice at most
            ended = {index: reason for index, _, reason in batch if reason is not None}
            for index, text, _ in batch:
                pending[index] += text
            for index in dict.fromkeys(index for index, _, _ in batch):
                reason = ended.get(index)
                due = sent[index] == 0 or job.counts[index] - sent[index] >= interval
                if pending[index] and (due or reason is not None):
                    sequence, prompt = job.sequences[index], not echoed[index]
                    logprobs = answer.choice_logprobs(sequence, sent[index], job.counts[index], prompt)
                    yield event(index, pending[index], None, logprobs)
                    pending[index], sent[index], echoed[index] = "", job.counts[index], True
                if reason is not None:
                    if reason.startswith("error"):
                        yield sse(error_body(f"the model failed: {reason}", "server_error", None, 500))
                        yield "data: [DONE]\n\n"
                        return
                    yield event(index, None if answer.chat else "", reason)
        if usage:
            yield sse({**answer.head, "choices": [], "usage": job_usage(job, prompt_tokens)})
        yield "data: [DONE]\n\n"
    finally:
        job.cancel(engine)  # the client went away (or we are done): free what still runs
