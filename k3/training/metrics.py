"""The run's metrics as it goes: `metrics.jsonl` in the output folder, and TensorBoard or wandb when asked.

metrics.jsonl holds one JSON object a line, one line per optimizer step:

    {"step": 12, "loss": 3.41, "lr": 0.003, "tokens_per_s": 4170.2, "grad_norm": 0.82}

with "val_bpb" (validation bits per byte) on the steps that evaluate, and a last line
{"step": N, "final_val_bpb": ..., "final_eval_tokens": n} after the final evaluation. "tokens_per_s" is
the step's own speed (its tokens over its seconds, evaluations apart); "grad_norm" the total gradient
norm before clipping. With QK-Clip on (k3.training.qk_clip) a step also has "max_logit", the largest
pre-softmax attention logit of the step over every head and layer (before the clip; null in a model
without softmax attention), and "qk_clipped_heads", how many heads the clip scaled down. Each line is
written whole and flushed as its step ends, so `tail -f` follows the run and a kill loses at most the
line being written.

A resumed run continues the log of the checkpoint it resumes (never truncating it): its lines up to
the checkpoint's step are kept, and lines of later steps, which the checkpoint does not hold and the
resumed run is about to take again, are dropped (as is a line cut short by a kill), so the log reads
as one run. `log` "tensorboard" (torch.utils.tensorboard, from the `tensorboard` package) or "wandb"
writes the same figures there; a package that is missing is a ValueError before any work.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..io import atomic_write

METRICS_FILE = "metrics.jsonl"

__all__ = ["METRICS_FILE", "MetricsLog", "check_logger", "read_metrics"]


def check_logger(log: str | None) -> None:
    """A ValueError in one line when `log`'s package is not installed (nothing is started)."""
    if log == "tensorboard":
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401  (imports the tensorboard package)
        except ImportError:
            raise ValueError(
                "--log tensorboard needs the tensorboard package, which is not installed: "
                "pip install tensorboard (or train without --log)"
            ) from None
    elif log == "wandb":
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ValueError(
                "--log wandb needs the wandb package, which is not installed: pip install wandb "
                "(or train without --log)"
            ) from None
    elif log is not None:
        raise ValueError(f"--log must be 'tensorboard' or 'wandb', got {log!r}")


def read_metrics(path) -> list[dict]:
    """The records of a metrics.jsonl, in order, up to the first line that is not a whole JSON object
    (a line cut short when the run was killed)."""
    records = []
    path = Path(path)
    if not path.exists():
        return records
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            break
        if not (line.endswith("\n") and isinstance(record, dict)):
            break
        records.append(record)
    return records


class MetricsLog:
    """metrics.jsonl in `out` (and the `log` backend), for a run that starts at `step`. `previous`: the
    folder of the checkpoint it resumes (None for a new run), whose log it continues."""

    def __init__(
        self, out: Path, step: int, previous: Path | None = None, log: str | None = None, run_config: dict | None = None
    ):
        self.path = Path(out) / METRICS_FILE
        self._start = (Path(out), step, None if previous is None else Path(previous), log, run_config or {})
        self._file = self._backend = None

    def _open(self) -> None:
        """At the first record, not before: a run that ends before its first step (refused input) leaves
        the folder's log as it was."""
        out, step, previous, log, run_config = self._start
        path = self.path
        if previous is None:  # a new run in this folder: a log of an earlier run there is replaced
            atomic_write(path, lambda tmp: Path(tmp).write_text(""))
        else:
            old = previous / METRICS_FILE
            records = read_metrics(old)
            kept = [r for r in records if isinstance(r.get("step"), int) and r["step"] <= step]
            if old.resolve() != path.resolve() or kept != records or _ends_cut(old):
                text = "".join(json.dumps(r) + "\n" for r in kept)
                atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
        self._file = open(path, "a", encoding="utf-8")
        self._backend = _open_backend(log, out, run_config)

    def write(self, record: dict) -> None:
        """Append `record` (a step's figures) as one line, flushed; a non-finite number is written as null."""
        if self._file is None:
            self._open()
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        if self._backend is not None:
            self._backend.write(clean)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._backend is not None:
            self._backend.close()
            self._backend = None


def _ends_cut(path: Path) -> bool:
    """True when the file's last line has no newline (a write cut short)."""
    if not path.exists() or path.stat().st_size == 0:
        return False
    with open(path, "rb") as f:
        f.seek(-1, 2)
        return f.read(1) != b"\n"


def _open_backend(log: str | None, out: Path, run_config: dict):
    if log is None:
        return None
    check_logger(log)
    return _TensorBoard(out) if log == "tensorboard" else _Wandb(out, run_config)


class _TensorBoard:
    """Scalars under train/ and val/ in `out`/tensorboard (`tensorboard --logdir OUT/tensorboard`)."""

    def __init__(self, out: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"))

    def write(self, record: dict) -> None:
        step = record["step"]
        for name, value in record.items():
            if name != "step" and isinstance(value, (int, float)):
                self.writer.add_scalar(_tag(name), value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    """A wandb run (project "k3", named after the output folder, its files in `out`/wandb)."""

    def __init__(self, out: Path, run_config: dict):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project="k3", name=out.name, dir=str(out), config=run_config)

    def write(self, record: dict) -> None:
        figures = {_tag(k): v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        self.run.log(figures, step=record["step"])

    def close(self) -> None:
        self.run.finish()


def _tag(name: str) -> str:
    return ("val/" if "val" in name or name.endswith("eval_tokens") else "train/") + name
