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
`load_chat_template` reads the checkpoint's template and compiles it once, at start-up, so a damaged
file or a template that is not Jinja is refused there, naming its file, not found out at each request. At
a request, the template's own raise_exception(...) is a `TemplateRefusal` (the conversation is the
client's to change); any other failure is the template's.
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


def longest_token_bytes(tokenizer) -> int | None:
    """The most bytes of text one token of `tokenizer` stands for, so that a text of n bytes has at least
    n / longest tokens (a server refuses a text too long by that count before tokenizing it); None when it
    cannot be known: a tokenizer other than k3's byte-level BPE (`k3.tokenizer.Tokenizer`), or one whose
    normalizer may shorten the text first. A byte-level token's count is `token_bytes`; a special or added
    token (<|endoftext|>) matches its own text, its UTF-8 length."""
    from ..tokenizer import Tokenizer

    if not isinstance(tokenizer, Tokenizer) or tokenizer.inner.normalizer is not None:
        return None
    counts, vocab = tokenizer.token_bytes, tokenizer.inner.get_vocab(with_added_tokens=True)
    return max((counts[i] if i < len(counts) and counts[i] else len(t.encode("utf-8"))) for t, i in vocab.items())


CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"


class TemplateRefusal(ValueError):
    """A chat template's own `raise_exception(...)`: the template refuses the conversation (the client's
    to change, HTTP 400), unlike any other failure of the template (the server's, HTTP 500)."""


def read_tokenizer_config(checkpoint: str | Path) -> dict:
    """The checkpoint's tokenizer_config.json as a dict ({} without one); a ValueError naming the file and
    what is wrong with it (not UTF-8, not JSON, not a JSON object), not a decoder's message without it."""
    path = Path(checkpoint) / TOKENIZER_CONFIG
    if not path.exists():
        return {}
    try:
        config = json.loads(_read_text(path, "a JSON object"))
    except json.JSONDecodeError as e:  # its message names no file
        raise ValueError(
            f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}): the file is damaged"
        ) from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a JSON {_json_kind(config)}, expected an object ({{...}}): the file is damaged")
    return config


def load_chat_template(checkpoint: str | Path | None) -> str | None:
    """The checkpoint's chat template (chat_template.jinja, else tokenizer_config.json's `chat_template`:
    a text, or transformers' named templates [{"name", "template"}], of which "default"), None without one;
    checked as Jinja (`compile_chat_template`) so that a broken one is refused here, naming its file, and
    not at each request. A ValueError naming the file for a template that cannot be read or compiled."""
    if checkpoint is None:
        return None
    folder = Path(checkpoint)
    jinja = folder / CHAT_TEMPLATE_FILE
    if jinja.exists():
        template, source = _read_text(jinja, "the chat template's Jinja text"), str(jinja)
    else:
        config, source = read_tokenizer_config(folder), f"{folder / TOKENIZER_CONFIG}: chat_template"
        template = _named_template(config.get("chat_template"), source)
    if template is not None:
        compile_chat_template(template, source)
    return template


def special_tokens(checkpoint: str | Path) -> dict:
    """bos_token and eos_token from tokenizer_config.json, for a chat template to use: each a text, or
    transformers' saved token {"content": text, ...}; another value is refused naming the field."""
    path, out = Path(checkpoint) / TOKENIZER_CONFIG, {}
    for name, value in read_tokenizer_config(checkpoint).items():
        if name not in ("bos_token", "eos_token") or value is None:
            continue
        text = value.get("content") if isinstance(value, dict) else value
        if not isinstance(text, str):
            raise ValueError(
                f'{path}: {name} is a JSON {_json_kind(value)}, expected a text or {{"content": text}}: '
                f"the file is damaged"
            )
        out[name] = text
    return out


def compile_chat_template(template, source: str):
    """`template` (Jinja text) compiled as `chat_prompt` renders it; a ValueError naming `source` (its file)
    and the line for a syntax error."""
    from jinja2 import TemplateSyntaxError

    if not isinstance(template, str):
        raise ValueError(f"{source}: expected the chat template's Jinja text, got {type(template).__name__}")
    try:
        return _environment().from_string(template)
    except TemplateSyntaxError as e:
        raise ValueError(f"{source}: the chat template is not valid Jinja: {e.message} (line {e.lineno})") from None


def chat_prompt(messages: list[dict], template=None, special: dict | None = None) -> str:
    """The prompt text of a conversation `messages` ([{"role", "content"}]) that asks for the assistant's
    next message: `template` (Jinja text, or `compile_chat_template`'s; rendered with
    add_generation_prompt=True and the `special` tokens, e.g. bos_token) or the plain template of the
    module docstring. The template's raise_exception(...) raises TemplateRefusal."""
    if template is not None:
        if isinstance(template, str):
            template = compile_chat_template(template, "chat_prompt: `template`")
        return template.render(messages=messages, add_generation_prompt=True, **(special or {}))
    lines = [f"{PLAIN_ROLES[m['role']]}: {m['content']}" for m in messages]
    return "\n".join(lines + ["Assistant:"])


def _environment():
    """Jinja as transformers renders a chat template: sandboxed, trim_blocks, lstrip_blocks, and
    raise_exception for the template to refuse a conversation with."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    return env


def _raise(message: str):
    raise TemplateRefusal(f"the chat template refused the conversation: {message}")


def _read_text(path: Path, expected: str) -> str:
    """The UTF-8 text of `path`; a ValueError naming it when it is a folder or not UTF-8."""
    if path.is_dir():
        raise ValueError(f"{path}: a folder, expected a file holding {expected}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at position {e.start}): the file is damaged"
        ) from None


def _named_template(template, source: str) -> str | None:
    """tokenizer_config.json's chat_template as a text: itself, or the "default" of transformers' named
    templates; None when absent. A ValueError naming `source` for anything else."""
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        names = []
        for i, item in enumerate(template):
            if not (isinstance(item, dict) and isinstance(item.get("name"), str) and "template" in item):
                raise ValueError(
                    f'{source}[{i}] is a JSON {_json_kind(item)}, expected {{"name": ..., "template": ...}} '
                    f"(transformers' named templates): the file is damaged"
                )
            names.append(item["name"])
            if item["name"] == "default":
                if not isinstance(item["template"], str):
                    raise ValueError(f"{source}[{i}].template is a JSON {_json_kind(item['template'])}, expected text")
                return item["template"]
        raise ValueError(f"{source}: named templates {names}, none named 'default', the one a chat request uses")
    raise ValueError(
        f"{source} is a JSON {_json_kind(template)}, expected a text or a list of named templates: the file is damaged"
    )


def _json_kind(value) -> str:
    kinds = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return kinds.get(type(value), "null" if value is None else type(value).__name__)
