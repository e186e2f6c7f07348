"""Tokenizers: byte-level BPE trained with Hugging Face `tokenizers` (GPT-2's scheme), and a plain
byte tokenizer (no training; for tests). Both are `tokenizers.Tokenizer`s saved as `tokenizer.json`,
with one special token, <|endoftext|>, that separates documents.

`token_bytes[i]` is how many bytes of text token i stands for (0 for the special token): validation
loss is reported in bits per byte with it, a figure that does not depend on the vocabulary.

A module of its own, below `k3.training`: training writes the tokenizer into its checkpoints, and the
command line, `k3.hf` and `k3.eval` read it from there.
"""

from __future__ import annotations

import os
from pathlib import Path

EOT = "<|endoftext|>"


class Tokenizer:
    """A byte-level `tokenizers.Tokenizer` with the few things training and generation need."""

    def __init__(self, inner):
        from tokenizers.pre_tokenizers import ByteLevel

        self.inner = inner
        self.eot_id = inner.token_to_id(EOT)
        if self.eot_id is None:
            raise ValueError(f"tokenizer has no {EOT} token")
        alphabet = set(ByteLevel.alphabet())
        vocab = inner.get_vocab()
        self.token_bytes = [0] * inner.get_vocab_size()
        for token, i in vocab.items():
            if token != EOT and all(ch in alphabet for ch in token):
                self.token_bytes[i] = len(token)  # each byte-level character is one byte

    @property
    def vocab_size(self) -> int:
        return self.inner.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(_unicode(text)).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.inner.encode_batch([_unicode(t) for t in texts])]

    def decode(self, ids) -> str:
        return self.inner.decode(list(ids), skip_special_tokens=False)

    def save(self, path: str | os.PathLike) -> None:
        self.inner.save(str(path))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"no tokenizer at {path}")
        try:
            inner = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
            raise ValueError(
                f"{path} is not a readable tokenizer.json ({e}); it is damaged or not a Hugging "
                f"Face tokenizers file: restore it from the run that wrote it"
            ) from e
        return cls(inner)


def _unicode(text: str) -> str:
    """`text`, refused with its position when it holds a lone surrogate, which no UTF-8 text has: Python
    makes one of each byte of a command-line argument that is not valid UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"the text has {text[e.start]!r} at character {e.start}, a lone surrogate, not a "
            f"character (Python reads bytes that are not UTF-8 this way, in a command-line argument "
            f"say); give UTF-8 text"
        ) from None
    except AttributeError:
        raise TypeError(f"expected text (str), got {type(text).__name__}") from None
    return text


def _byte_level(model):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, pre_tokenizers

    tok = HFTokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def bpe_trainer_bytes(vocab_size: int) -> int:
    """What `train_bpe` allocates before it starts: the trainer (Rust) reserves a table of `vocab_size`
    entries, about 100 bytes each, and aborts the whole process when that allocation fails, so a caller
    compares this with the memory it has first (`k3.runtime.refuse_if_over_memory`)."""
    return 100 * vocab_size


def train_bpe(texts: list[str], vocab_size: int = 4096) -> Tokenizer:
    """Byte-level BPE with `vocab_size` entries (256 bytes + <|endoftext|> + merges) learned from texts."""
    from tokenizers import models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ValueError(f"train_bpe: `vocab_size` must be at least 257 (256 bytes + {EOT}), got {vocab_size}")
    tok = _byte_level(models.BPE())
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(tok)


def byte_tokenizer() -> Tokenizer:
    """256 byte tokens + <|endoftext|>: no training, 1 byte per token."""
    from tokenizers import models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab[EOT] = len(vocab)
    tok = _byte_level(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens([EOT])
    return Tokenizer(tok)
