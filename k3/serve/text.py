"""Text around the engine's token ids: streaming detokenization with stop strings, and chat prompts.

`TextStream` turns a sequence's tokens into text as they come: a character split over several byte-level
tokens is passed on once whole, and text that could still become a stop string is held back until it
cannot (OpenAI's `stop`: the returned text ends before the first stop string, which is not included).

`chat_prompt` renders a conversation: with the checkpoint's own chat template where it has one
(`chat_template` in tokenizer_config.json, or chat_template.jinja, Jinja as transformers renders it),
otherwise k3's plain role-tagged template, one line a message and an open assistant line:

    System: You are terse.
    User: Hello
    Assistant:

whose stop strings (`PLAIN_STOPS`) end the reply where the model starts another message.
"""

from __future__ import annotations

import json
from pathlib import Path

PLAIN_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}
PLAIN_STOPS = ["\nUser:", "\nSystem:"]


class TextStream:
    """The text of a growing list of token ids, handed out in pieces (`push`) that never split a character
    or run into a stop string."""

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.text = ""  # the text of every whole character so far
        self.sent = 0  # characters of `text` handed out
        self._pending: list[int] = []  # ids whose bytes do not yet end on a character boundary
        self.stopped = False

    def push(self, token: int) -> str:
        """Add a token; return the new text that is safe to send ('' while waiting). After a stop string
        is seen, `stopped` is True and the text ends before it."""
        if self.stopped:
            return ""
        self.ids.append(token)
        self._pending.append(token)
        piece = self.tokenizer.decode(self._pending)
        if piece.endswith("\ufffd") and len(self._pending) < 4:  # a UTF-8 character has at most 4 bytes
            return ""
        self._pending = []
        self.text += piece
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text once the sequence has ended (a last partial character included)."""
        if self._pending and not self.stopped:
            self.text += self.tokenizer.decode(self._pending)
            self._pending = []
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        start = max(0, self.sent - max((len(s) for s in self.stop), default=0))
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
            end = len(self.text)
        elif final:
            end = len(self.text)
        else:
            end = len(self.text) - self._held_back()
        out = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out

    def _held_back(self) -> int:
        """Characters at the end of the text that begin some stop string (they may yet complete it). Only
        text not yet handed out can be held back (a longer match would have been held back before), so
        each token costs what is pending, not the whole text: long stop strings and long answers stay cheap."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text) - self.sent), longest, -1):
                if self.text.endswith(s[:n]):
                    longest = n
                    break
        return longest


def load_chat_template(checkpoint: str | Path | None) -> str | None:
    """The checkpoint's chat template (tokenizer_config.json's `chat_template`, or chat_template.jinja), if any."""
    if checkpoint is None:
        return None
    folder = Path(checkpoint)
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    config = folder / "tokenizer_config.json"
    if config.is_file():
        template = json.loads(config.read_text()).get("chat_template")
        if isinstance(template, list):  # transformers' named templates: [{"name": ..., "template": ...}]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return template if isinstance(template, str) else None
    return None


def chat_prompt(messages: list[dict], template: str | None = None, special: dict | None = None) -> str:
    """The prompt text of a conversation `messages` ([{"role", "content"}]) that asks for the assistant's
    next message: `template` (Jinja, rendered with add_generation_prompt=True and the `special` tokens,
    e.g. bos_token) or the plain template of the module docstring."""
    if template is not None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        return env.from_string(template).render(messages=messages, add_generation_prompt=True, **(special or {}))
    lines = [f"{PLAIN_ROLES[m['role']]}: {m['content']}" for m in messages]
    return "\n".join(lines + ["Assistant:"])


def _raise(message: str):
    raise ValueError(f"the chat template refused the conversation: {message}")
