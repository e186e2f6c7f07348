"""The model `k3 lab inspect` looks at: a k3 checkpoint loaded with its tokenizer and training settings,
or, without one, kimi-k3-tiny trained here (seed 0) unless the mode's run has already finished with the
same settings; and the text it is read on: windows of the run's validation documents and the sample
prompt (a word sequence said twice)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ...models import CausalLM
from ..text import paragraph

# training runs by mode (kimi-k3-tiny on the default Shakespeare corpus, seed 0); smoke trains on a
# generated corpus in a temporary folder instead
TRAINING = {
    "quick": dict(
        max_steps=200,
        batch_size=8,
        seq_len=256,
        warmup_steps=20,
        eval_every=200,
        eval_tokens=8192,
        final_eval_tokens=32768,
        out="runs/lab-inspect",
    ),
    "full": dict(
        max_steps=1000,
        batch_size=16,
        seq_len=256,
        warmup_steps=50,
        eval_every=250,
        eval_tokens=16384,
        final_eval_tokens=262144,
        out="runs/lab-inspect-full",
    ),
}
# words in an order no text has, said twice: attention from the second copy back to the first is retrieval
PROMPT_WORDS = " sweet night the crown hath pale fire and my gentle lord upon a rose"


def training_config(mode: str, root: Path | None = None):
    """The TrainConfig this experiment trains with in `mode` ("smoke": a generated corpus under `root`)."""
    from ...training import TrainConfig

    if mode == "smoke":
        if root is None:
            raise ValueError("training_config: smoke mode needs a `root` folder for its corpus and checkpoint")
        return TrainConfig(
            preset="kimi-k3-tiny",
            model_overrides={"hidden_size": 32},
            data=str(write_corpus(root)),
            tokenizer="byte",
            seq_len=32,
            batch_size=2,
            max_steps=4,
            warmup_steps=2,
            eval_every=4,
            eval_tokens=256,
            final_eval_tokens=512,
            out=str(root / "checkpoint"),
            val_fraction=0.2,
            seed=0,
        )
    return TrainConfig(preset="kimi-k3-tiny", seed=0, **TRAINING[mode])


def write_corpus(root: Path, docs: int = 4, words: int = 600) -> Path:
    """A small corpus of seeded word sequences (no download): `docs` files under root/corpus."""
    vocab = (
        "to be or not that is the question whether tis nobler in the mind to suffer the slings and "
        "arrows of outrageous fortune"
    ).split()
    folder = Path(root) / "corpus"
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    for d in range(docs):
        ids = torch.randint(0, len(vocab), (words,), generator=gen).tolist()
        (folder / f"doc{d}.txt").write_text(" ".join(vocab[i] for i in ids) + "\n")
    return folder


def finished(out: Path, cfg) -> bool:
    """Whether `out` holds the final checkpoint of a run with exactly the settings `cfg`."""
    try:
        saved = json.loads((Path(out) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    from ...training.checkpoint import recorded_settings

    asked = json.loads(json.dumps(recorded_settings(cfg)))
    kept = saved.get("train")
    same = isinstance(kept, dict) and {k: v for k, v in kept.items() if k != "overwrite"} == {
        k: v for k, v in asked.items() if k != "overwrite"
    }  # (how the run was allowed into its folder aside)
    return same and saved.get("step") == cfg.max_steps and (Path(out) / "model.safetensors").exists()


def trained_checkpoint(mode: str, root: Path | None = None) -> tuple[Path, bool]:
    """(checkpoint folder, whether it was trained now): the mode's run, trained unless already finished."""
    from ...training import train

    cfg = training_config(mode, root)
    out = Path(cfg.out)
    if finished(out, cfg):
        return out, False
    train(dataclasses.replace(cfg, overwrite=True), progress=False)  # the lab's own folder: an unfinished run
    return out, True


def load(checkpoint: Path):
    """(model in eval mode, tokenizer, train config or None) from a k3 checkpoint folder."""
    from ...io import reading
    from ...tokenizer import Tokenizer
    from ...training.config import saved_train_config

    checkpoint = Path(checkpoint)
    if not (checkpoint / "config.json").exists():
        raise FileNotFoundError(f"--checkpoint {checkpoint}: no config.json there (a folder from `k3 train --out`)")
    if not (checkpoint / "tokenizer.json").exists():
        raise FileNotFoundError(
            f"--checkpoint {checkpoint}: no tokenizer.json there; k3 lab inspect needs a "
            f"checkpoint written by `k3 train`"
        )
    with reading(checkpoint):  # under the folder's lock, a save that died after its commit point finished
        model = CausalLM.from_pretrained(checkpoint).eval()
        tokenizer = Tokenizer.load(checkpoint)
        saved = json.loads((checkpoint / "config.json").read_text())
    cfg = saved_train_config(saved["train"]) if isinstance(saved.get("train"), dict) else None
    return model, tokenizer, cfg


def validation_windows(tokenizer, cfg, tokens: int, notes: list[str]) -> torch.Tensor:
    """[n, seq_len + 1] windows of the run's validation documents (its corpus, split and seed), evenly
    spread, about `tokens` tokens in all; a fixed text when the run's corpus cannot be read."""
    from ...training import TokenData
    from ...training.data import CorpusError, load_corpus, split_documents

    seq_len = cfg.seq_len if cfg is not None else 256
    texts = None
    if cfg is not None:
        try:
            _, val = split_documents(load_corpus(cfg.data), cfg.val_fraction, cfg.seed)
            texts = [d.text for d in val]
        except (CorpusError, OSError) as e:
            notes.append(paragraph("inspect", "no-corpus", error=e))
    if texts is None:
        texts = [(PROMPT_WORDS.strip() + ". ") * 200]
    data = TokenData(tokenizer, [], texts)
    seq_len = min(seq_len, data.val.numel() - 1)
    return data.val_windows(seq_len, tokens)


def prompt_ids(tokenizer) -> tuple[list[int], int]:
    """The sample prompt: PROMPT_WORDS tokenized once and said twice; returns (ids, period)."""
    ids = tokenizer.encode(PROMPT_WORDS)
    return ids + ids, len(ids)
