"""`k3 lab inspect`: pictures of what a trained K3 learned.

From a checkpoint (`k3 lab inspect --checkpoint DIR`, a directory written by `k3 train --out DIR`), or,
without one, from kimi-k3-tiny trained here for a fixed number of steps on the default corpus (seed 0,
kept in runs/lab-inspect and reused while its settings match):

- AttnRes depth weights: for every AttnRes mix (before each layer's attention and FFN, and the final
  one), the softmax weights over its sources [embedding, block sums, the current block's partial sum],
  averaged over the tokens of validation text; and how far from uniform they are per token.
- Expert load per MoE layer: the share of routed assignments each expert gets on validation text, with
  the aux-loss-free correction bias (as the model routes) and without it (top-k on the bare scores), the
  max/mean imbalance of each, and the bias itself.
- KDA decay per channel and head: the log decay g of the forget gate, as a half-life ln 2 / -g in tokens,
  per (head, key channel) averaged in log space over validation tokens, and its distribution.
- MLA attention over a sample prompt (a word sequence said twice): the softmax probabilities of every
  MLA head, and how much of it goes back to the earlier copy (retrieval from the context).

Everything is read with forward hooks on the unmodified model, each calling the layer's own analysis
method on the inputs it was given (`BlockAttnRes.weights`, `Router.scores` / `Router.choose`,
`KimiDeltaAttention.forget_gate`, `MultiHeadLatentAttention.attention_probs`): the same code the layers'
forward passes run, so the pictures show what the model computes.

The package: `checkpoint` (the model and the text it is read on), `recorder` (the hooks), `stats`
(statistics and verdicts), `report` (one section per part); here `run`.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from ...bench.timing import threads
from ...models import CausalLM
from ..report import Result, command
from ..text import paragraph
from . import report
from .checkpoint import PROMPT_WORDS, load, prompt_ids, trained_checkpoint, validation_windows
from .recorder import record, record_attention
from .stats import ATTN_RES_SELECTIVE, BALANCED, CHANNEL_SPREAD, RETRIEVAL

SAMPLE_TOKENS = {"smoke": 256, "quick": 4096, "full": 16384}  # validation tokens the statistics average over


def run(mode: str, docs: Path, checkpoint: str | None = None, **options) -> Result:
    if options:
        raise ValueError(f"k3 lab inspect takes only `checkpoint`, got {sorted(options)}")
    if mode not in SAMPLE_TOKENS:
        raise ValueError(f"k3 lab inspect: `mode` must be one of {tuple(SAMPLE_TOKENS)}, got {mode!r}")
    docs = Path(docs)
    if checkpoint is not None:
        return _inspect(mode, docs, Path(checkpoint), trained_now=False, given=True)
    if mode == "smoke":  # a few steps of a random tiny model on a generated corpus, in a temporary folder,
        # on one thread (a test on a busy machine: a two-thread pool waits for cores it is not given)
        with tempfile.TemporaryDirectory(prefix="k3-lab-inspect-") as tmp, threads(1):
            path, _ = trained_checkpoint(mode, Path(tmp))
            return _inspect(mode, docs, path, trained_now=True, given=False)
    path, now = trained_checkpoint(mode)
    return _inspect(mode, docs, path, trained_now=now, given=False)


def _inspect(mode: str, docs: Path, checkpoint: Path, trained_now: bool, given: bool) -> Result:
    notes: list[str] = []
    model, tokenizer, cfg = load(checkpoint)
    config = model.config
    windows = validation_windows(tokenizer, cfg, SAMPLE_TOKENS[mode], notes)
    trained = record(model, windows)
    torch.manual_seed(cfg.seed if cfg is not None else 0)
    initial = record(CausalLM(config).eval(), windows)  # the same architecture at initialisation
    ids, period = prompt_ids(tokenizer)
    attention = record_attention(model, ids)

    claims, tables, figures = [], [], []
    for part in (report.attn_res_part, report.moe_part, report.kda_part):
        c, t, f, n = part(docs, trained, initial)
        claims += c
        tables += t
        figures += f
        notes += n
    c, t, f, n = report.mla_part(docs, attention, tokenizer, ids, period)
    claims, tables, figures, notes = claims + c, tables + t, figures + f, notes + n

    history = _history(checkpoint)
    where = (
        "origin-given"
        if given
        else "origin-smoke"
        if mode == "smoke"
        else ("origin-now" if trained_now else "origin-reused")
    )
    held = paragraph("inspect", "model-history", steps=history["steps"], bpb=history["val_bpb"]) if history else ""
    notes.insert(
        0,
        paragraph(
            "inspect",
            "model",
            origin=paragraph("inspect", where, checkpoint=checkpoint),
            name=config.name,
            layers=config.num_layers,
            kinds=_layers(config),
            width=config.hidden_size,
            history=held,
        ),
    )
    notes.append(
        paragraph(
            "inspect",
            "statistics",
            windows=windows.shape[0],
            tokens=windows.shape[1] - 1,
            seed=cfg.seed if cfg is not None else 0,
        )
    )
    setup = dict(
        checkpoint=str(checkpoint),
        given=given,
        seed=cfg.seed if cfg is not None else None,
        train=None
        if cfg is None
        else {
            k: getattr(cfg, k)
            for k in ("preset", "model_overrides", "data", "tokenizer", "seq_len", "batch_size", "max_steps", "lr")
        },
        sample_windows=list(windows.shape),
        prompt=PROMPT_WORDS,
        thresholds=dict(
            attn_res_entropy=ATTN_RES_SELECTIVE,
            balanced_max_over_mean=BALANCED,
            channel_spread=CHANNEL_SPREAD,
            retrieval=RETRIEVAL,
        ),
        **(history or {}),
    )
    return Result(
        name="inspect",
        title="What a trained K3 learned",
        mode=mode,
        command=command("inspect", mode) + (f" --checkpoint {checkpoint}" if given else ""),
        claims=claims,
        tables=tables,
        figures=figures,
        notes=notes,
        setup=setup,
    )


def _history(checkpoint: Path) -> dict | None:
    from ...io import reading

    try:
        with reading(checkpoint):
            state = torch.load(checkpoint / "trainer_state.pt", weights_only=True)
    except (OSError, RuntimeError):
        return None
    h = state.get("history", {})
    if "final_val_bpb" not in h:
        return None
    return {"steps": state["step"], "val_bpb": h["final_val_bpb"], "train_seconds": round(h.get("seconds", 0.0), 1)}


def _layers(config) -> str:
    counts: dict[str, int] = {}
    for kind in config.layer_types:
        counts[kind] = counts.get(kind, 0) + 1
    return " + ".join(f"{n} {k}" for k, n in counts.items())
