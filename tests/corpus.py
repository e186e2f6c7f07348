"""A tiny synthetic corpus for training tests: no download, same text every run."""

from pathlib import Path

import torch

WORDS = "to be or not that is the question whether tis nobler in mind suffer slings arrows".split()


def write_corpus(root: Path, docs: int, words: int, ending: str = "\n") -> Path:
    """`docs` files doc0.txt ... of `words` random words each (seed 0), each ending with `ending`."""
    g = torch.Generator().manual_seed(0)
    for d in range(docs):
        ids = torch.randint(0, len(WORDS), (words,), generator=g).tolist()
        (root / f"doc{d}.txt").write_text(" ".join(WORDS[i] for i in ids) + ending)
    return root
