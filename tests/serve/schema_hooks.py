"""schemathesis hooks for tests/serve/test_schema.py (loaded by the CLI through $SCHEMATHESIS_HOOKS): drop a
generated schema-valid request whose prompt's *tokens* pass the served model's length, which no JSON Schema
can state (a text's length in characters does not bound its tokens). The server's tokenizer and chat template
count them, as it does; $K3_MAX_MODEL_LEN is the length it serves."""

from __future__ import annotations

import os

import schemathesis

from k3.serve.text import chat_prompt
from k3.tokenizer import byte_tokenizer

TOKENIZER = byte_tokenizer()


def prompt_tokens(body: dict) -> list[int]:
    """The token counts of the prompts a completion or chat body holds (as the server tokenizes them)."""
    if "messages" in body:
        messages = []
        for m in body["messages"]:
            content = m["content"] if isinstance(m["content"], str) else "\n".join(p["text"] for p in m["content"])
            messages.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
        return [len(TOKENIZER.encode(chat_prompt(messages)))]
    prompt = body["prompt"]
    prompts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
    return [len(TOKENIZER.encode(p)) if isinstance(p, str) else len(p) for p in prompts]


@schemathesis.hook
def filter_case(context, case) -> bool:
    body = case.body
    if not isinstance(body, dict) or case.meta is None or not case.meta.generation.mode.is_positive:
        return True
    try:
        counts = prompt_tokens(body)
    except (KeyError, TypeError, ValueError, UnicodeError):
        return True  # not a body the server counts tokens of: it refuses it first
    return all(n < int(os.environ["K3_MAX_MODEL_LEN"]) for n in counts)
