"""What a resumed run takes from its checkpoint and what from the command (`_resume_overrides`: the saved
configuration rules, but for RESUME_ADJUSTABLE; any other setting asked for that differs is an error naming
it), and where the run reads and writes (`_share`, `_same_folder`)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from .config import TrainConfig, qk_clip_threshold


def _same_folder(a, b) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _share(parallel: str) -> tuple[int, int]:
    """(rank, processes) of this process in a torchrun job (`--parallel` other than none), else (0, 1):
    the processes split the hashing of a checkpoint's files."""
    from .parallel.dims import launch

    here = launch()
    return (0, 1) if parallel == "none" or not here.under_torchrun else (here.rank, here.world)


def _resume_overrides(
    requested: TrainConfig, saved: TrainConfig, asked: tuple[str, ...] = (), corpus_known: bool = False
) -> dict:
    """On resume the saved configuration rules. A field of `requested` that differs from the default,
    or is named in `asked`, was asked for: the run's length, evaluation, machine and logging settings
    (RESUME_ADJUSTABLE) change; any other that differs from the checkpoint's (its data, model,
    tokenizer, optimizer, batch, seed...) is an error that names it, instead of being silently ignored
    or silently changing the model. `corpus_known`: the checkpoint holds its corpus's fingerprint, so
    `data` may name where the corpus is now (check_same_corpus refuses another one)."""
    defaults = TrainConfig()
    changes, conflicts = {}, []
    for f in dataclasses.fields(TrainConfig):
        value = getattr(requested, f.name)
        if value == getattr(defaults, f.name) and f.name not in asked:
            continue
        if f.name in RESUME_ADJUSTABLE or (f.name == "data" and corpus_known and value is not None):
            changes[f.name] = value
        elif not _same_setting(f.name, value, _effective(saved, f.name)):
            conflicts.append(f"`{f.name}` {value!r} (the checkpoint's: {_effective(saved, f.name)!r})")
    if conflicts:
        raise ValueError(
            f"--resume: {'; '.join(conflicts)}: a resumed run keeps its checkpoint's settings except "
            f"{', '.join(RESUME_ADJUSTABLE)}; drop the others to resume, or train a new run with "
            f"them (another --out)"
        )
    if "max_steps" in changes:
        changes["time_budget"] = None
        if saved.warmup_steps is not None and saved.warmup_steps > changes["max_steps"]:
            raise ValueError(
                f"--max-steps {changes['max_steps']}: the checkpoint's run warms up over {saved.warmup_steps} steps "
                f"(its --warmup), more than that; give --max-steps {saved.warmup_steps} or more"
            )
    return changes


# What each launch chooses (everything else — the model, data, tokenizer, optimizer and its schedule, the
# batch, the seed — the checkpoint keeps): the run's length, evaluation cadence, saving, the machine and the
# process layout, logging.
RESUME_ADJUSTABLE = (
    "max_steps",
    "eval_every",
    "eval_tokens",
    "final_eval_tokens",
    "checkpoint_every",
    "async_checkpoint",
    "threads",
    "out",
    "overwrite",
    "compile",
    "device",
    "precision",
    "log",
    "recompute",
    "ep",
)


def _effective(cfg: TrainConfig, name: str):
    """The setting `name` of `cfg` as the run applies it (`qk_clip` None: its optimizer's default)."""
    return qk_clip_threshold(cfg) if name == "qk_clip" else getattr(cfg, name)


def _same_setting(name: str, a, b) -> bool:
    if name == "data" and a is not None and b is not None:  # the same corpus, however its path is written
        return Path(a).resolve() == Path(b).resolve()
    return a == b


def _check_saved_data(saved: TrainConfig, resume: str, corpus_known: bool) -> None:
    """The checkpoint's corpus path, when it is not there: a relative one that older k3 recorded (k3 now
    records it absolute) is named as such; a moved corpus can be named with --data when the checkpoint
    holds its fingerprint (`corpus_known`), which is checked (check_same_corpus)."""
    if saved.data is None or Path(saved.data).exists():
        return
    if corpus_known:
        raise ValueError(
            f"--resume {resume}: the checkpoint's corpus {saved.data} is not there; give --data with where it "
            f"is now (the tokens are checked to be the ones the run trained on)"
        )
    if not Path(saved.data).is_absolute():
        raise ValueError(
            f"--resume {resume}: the checkpoint's corpus (its --data {saved.data!r}) is a path relative to the "
            f"folder it was trained from, and {os.getcwd()} has no {saved.data!r}: resume from that folder"
        )
    raise ValueError(
        f"--resume {resume}: the checkpoint's corpus {saved.data} is not there; put it back at that path to resume"
    )


def check_same_corpus(saved: str | None, now: str, data, path: str | None) -> None:
    """A resumed run reads the token streams it trained on: `saved` (the checkpoint's fingerprint; None in
    a checkpoint older k3 wrote, taken as it is) against `now` (TokenData.fingerprint of `data`)."""
    if saved is not None and saved != now:
        where = "the Shakespeare corpus" if path is None else f"--data {path}"
        raise ValueError(
            f"--resume: {where} is not the corpus the run trained on (its tokens differ from the checkpoint's "
            f"record: now {data.train.numel():,} training and {data.val.numel():,} validation tokens); restore "
            f"that corpus, or train a new run on this one (another --out)"
        )
