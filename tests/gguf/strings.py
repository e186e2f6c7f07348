"""Text for the tokenizer comparison: a training text that gives the BPE merges over every kind of
character, and 200 strings mixing whitespace runs, Unicode scripts, digits, emoji and contractions."""

from __future__ import annotations

import random

PIECES = [
    "hello",
    "world",
    "ROMEO:",
    "don't",
    "I'll",
    "we're",
    "it's",
    "THE",
    "Thou",
    "naïve",
    "café",
    "Straße",
    "中文字符",
    "日本語のテキスト",
    "Русский",
    "текст",
    "العربية",
    "ελληνικά",
    "한국어",
    "हिन्दी",
    "12345",
    "3.14159",
    "2026-12-07",
    "1,000,000",
    "0x1F",
    "42",
    "7",
    "👍",
    "👍🏽",
    "👨‍👩‍👧",
    "🇧🇷",
    "🙂🙂",
    "★",
    "→",
    "€100",
    "½",
    "!",
    "?!",
    "...",
    "—",
    "“quoted”",
    "(paren)",
    "[x]",
    "{y}",
    "#tag",
    "@user",
    "a_b",
    "path/to/file.txt",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n",
    " \n ",
    "\r\n",
    "\u00a0",
    "\u3000",
]


def training_text(n: int = 4000, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(PIECES) + rng.choice([" ", " ", "", "\n", "  "]) for _ in range(n))


def sample_strings(count: int = 200, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        words = [rng.choice(PIECES) for _ in range(rng.randint(1, 12))]
        joiners = [rng.choice(["", " ", "  ", "\n", "\t", " \n"]) for _ in words]
        out.append("".join(w + j for w, j in zip(words, joiners)))
    return out
