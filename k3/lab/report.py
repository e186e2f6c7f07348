"""What an experiment returns and how `docs/results.md` is written from it.

Each experiment (`k3 lab NAME`) returns a `Result`: the article's claims beside the measured figures, tables,
figures (PNGs under `docs/figures/`) and the command that produced them. The result is saved as
`docs/lab/NAME.json`; `docs/results.md` is re-rendered from every saved result, in the order of
`k3.lab.EXPERIMENTS`, so running one experiment updates its section and keeps the others.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..io import atomic_write
from .text import text

VERDICTS = ("holds", "partly", "does not hold", "not measurable here")


@dataclass
class Claim:
    """One of the article's claims, what we measured, and whether the measurement supports it."""

    claim: str
    measured: str
    verdict: str

    def __post_init__(self):
        if self.verdict not in VERDICTS:
            raise ValueError(f"Claim.verdict must be one of {VERDICTS}, got {self.verdict!r}")


@dataclass
class Table:
    caption: str
    header: list[str]
    rows: list[list]

    def __post_init__(self):
        for i, row in enumerate(self.rows):
            if len(row) != len(self.header):
                raise ValueError(f"Table {self.caption!r}: row {i} has {len(row)} cells, the header {len(self.header)}")

    def markdown(self) -> str:
        def cell(x) -> str:
            if isinstance(x, float):
                return f"{x:.3g}" if abs(x) < 1e4 else f"{x:,.0f}"
            return str(x)

        lines = [
            f"*{self.caption}*",
            "",
            "| " + " | ".join(self.header) + " |",
            "|" + "|".join(["---"] * len(self.header)) + "|",
        ]
        lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in self.rows]
        return "\n".join(lines)


@dataclass
class Figure:
    path: str  # relative to the docs folder, e.g. "figures/recall.png"
    caption: str


@dataclass
class Result:
    name: str
    title: str
    mode: str
    command: str
    claims: list[Claim] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    setup: dict = field(default_factory=dict)  # the sizes, steps and seeds behind the numbers
    data: dict = field(default_factory=dict)  # raw measurements, kept in the JSON, not rendered
    machine: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Result":
        d = dict(d)
        d["claims"] = [Claim(**c) for c in d.get("claims", [])]
        d["tables"] = [Table(**t) for t in d.get("tables", [])]
        d["figures"] = [Figure(**f) for f in d.get("figures", [])]
        return cls(**d)

    def markdown(self) -> str:
        out = [
            f"## {self.title}",
            "",
            f"`{self.command}` ({self.mode} mode, {self.seconds / 60:.1f} min"
            + (f", {self.machine.get('summary')}" if self.machine.get("summary") else "")
            + ")",
            "",
        ]
        if self.claims:
            out += ["| the article says | measured here | verdict |", "|---|---|---|"]
            out += [f"| {c.claim} | {c.measured} | **{c.verdict}** |" for c in self.claims]
            out.append("")
        for table in self.tables:
            out += [table.markdown(), ""]
        for fig in self.figures:
            out += [f"![{fig.caption}]({fig.path})", "", f"*{fig.caption}*", ""]
        for note in self.notes:
            out += [f"- {note}"]
        if self.notes:
            out.append("")
        if self.setup:
            out += [
                "<details><summary>setup</summary>",
                "",
                "```json",
                json.dumps(self.setup),
                "```",
                "",
                "</details>",
                "",
            ]
        return "\n".join(out)


def machine_summary() -> dict:
    import os

    import torch

    return {
        "summary": f"{os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads",
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"),
        "commit": source_commit(),
    }


def source_commit() -> str | None:
    """The git commit of the k3 source that ran ("+changes" when its files differ from it), or None outside
    a git checkout."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=10", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", "k3"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


LAB_MARK = ".k3-lab"  # in a folder the lab writes into: it claimed the folder (its files are the lab's to replace)
LAB_NAMES = ("results.md", "lab", "figures")  # what the lab writes in its folder


def claim_folder(docs: str | Path) -> None:
    """Make `docs` the lab's folder, or refuse it (FileExistsError) before anything runs: the lab replaces only
    files it wrote. A folder is the lab's when it is new, when it carries the lab's mark (`LAB_MARK`, left by an
    earlier claim), or when its results.md is the lab's page; otherwise a results.md, lab/ or figures/ there is
    the user's, and the lab writes nowhere near it."""
    docs = Path(docs)
    page = docs / "results.md"
    ours = (docs / LAB_MARK).exists() or (page.is_file() and page.read_text(errors="replace").startswith(HEADER[:20]))
    taken = [name for name in LAB_NAMES if (docs / name).exists() and not (name == "lab" and _lab_files(docs / name))]
    if taken and not ours:
        raise FileExistsError(
            f"--docs {docs}: it holds {', '.join(taken)}, which k3 lab did not write and would "
            f"replace; choose another --docs folder (a new one, or one k3 lab wrote)"
        )
    docs.mkdir(parents=True, exist_ok=True)
    if not (docs / LAB_MARK).exists():
        atomic_write(
            docs / LAB_MARK,
            lambda tmp: Path(tmp).write_text("k3 lab writes results.md, lab/ and figures/ in this folder\n"),
        )


def _lab_files(folder: Path) -> bool:
    """Whether every file under `folder` is one the lab writes there: a result (NAME.json) or a kept cell."""
    for path in folder.rglob("*"):
        if path.is_dir():
            continue
        try:
            kept = json.loads(path.read_text(encoding="utf-8")) if path.suffix == ".json" else None
        except (OSError, ValueError):
            kept = None
        if not isinstance(kept, dict) or not ({"plan", "result"} <= kept.keys() or {"name", "claims"} <= kept.keys()):
            return False
    return True


def result_file(name: str, mode: str) -> str:
    """Where a result is kept under docs/lab: NAME.json, and NAME-full.json for a --full run, so that the
    larger sweep sits beside the quick one instead of replacing it."""
    return f"{name}-full.json" if mode == "full" else f"{name}.json"


def save_result(result: Result, docs: Path) -> Path:
    path = Path(docs) / "lab" / result_file(result.name, result.mode)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result.to_dict(), indent=1)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))
    return path


def load_results(docs: Path, order: list[str]) -> list[Result]:
    folder = Path(docs) / "lab"
    results = []
    for name in order:
        for path in (folder / result_file(name, "quick"), folder / result_file(name, "full")):
            if path.exists():
                results.append(Result.from_dict(json.loads(path.read_text())))
    return results


HEADER = text("report", "header") + "\n"  # the page's opening words: k3/lab/templates/report.md


def write_results(docs: Path, order: list[str]) -> Path:
    """Render `docs/results.md` from every saved result."""
    results = load_results(docs, order)
    parts = [HEADER]
    commits = sorted({str(r.machine.get("commit")) for r in results if r.machine.get("commit")})
    if commits:
        parts.append(f"Generated from k3 commit {', '.join(commits)}.\n")
    if results:
        parts.append("| experiment | claims holding | mode | minutes |\n|---|---|---|---|")
        for r in results:
            holds = sum(c.verdict == "holds" for c in r.claims)
            parts.append(
                f"| [{r.title}](#{_anchor(r.title)}) | {holds} of {len(r.claims)} | {r.mode} | {r.seconds / 60:.1f} |"
            )
        parts.append("")
    parts += [r.markdown() for r in results]
    path = Path(docs) / "results.md"
    text = "\n".join(parts)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))
    return path


def _anchor(title: str) -> str:
    keep = "".join(ch for ch in title.lower() if ch.isalnum() or ch in " -")
    return keep.replace(" ", "-")


def command(name: str, mode: str) -> str:
    """The command line that reproduces a result."""
    return f"k3 lab {name} --{mode}"
