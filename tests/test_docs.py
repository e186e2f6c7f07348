"""The documentation does what it says: the README and every page under docs/ are checked as written.

- every ```python block runs (in a temporary folder), unless a dedicated test runs it and asserts what
  it claims: then the line before the block names that test, `<!-- tested-by: tests/FILE.py::test_name -->`,
  and the test must exist; a block that cannot run here says why, `<!-- no-test: the reason -->`;
- every command line of a ```bash block parses: `k3 ...` (also after `torchrun ... -m k3`, `python -m k3`
  or environment variables) with k3's own parser, the options of `k3 eval`, `python -m k3.eval` and
  `lm_eval` with lm-eval's, and `make X` names a target of the Makefile; a line of any other command fails
  (add a check for it here);
- every relative link and image points to a file that exists (the README's from the repository's root).

docs/layout.md ("The documentation") says the same for whoever writes a page.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]

# a fence at the start of a line, with the marker comment on the line before it if there is one
FENCE = re.compile(
    r"^(?:<!--[ \t]*(?P<marker>[\w-]+):[ \t]*(?P<note>.*?)[ \t]*-->\n)?"
    r"```(?P<lang>[\w-]*)[ \t]*\n(?P<code>.*?)^```[ \t]*$",
    re.M | re.S,
)
MARKERS = ("tested-by", "no-test")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence
    lang: str
    code: str
    marker: str | None
    note: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    found = []
    for m in FENCE.finditer(text):
        fence = m.start("lang") - 3
        found.append(Block(page, text.count("\n", 0, fence) + 1, m["lang"], m["code"], m["marker"], m["note"] or ""))
    return found


ALL_BLOCKS = [b for page in PAGES for b in blocks(page)]


def python_block(page: str | Path, containing: str) -> str:
    """The one ```python block of `page` (a path from the repository's root, or a Path) that contains
    `containing`: how a dedicated test finds the block it runs."""
    path = page if isinstance(page, Path) else ROOT / page
    found = [b.code for b in blocks(path) if b.lang == "python" and containing in b.code]
    assert len(found) == 1, f"{path.relative_to(ROOT)}: {len(found)} python blocks contain {containing!r}, expected 1"
    return found[0]


def run_block(code: str, filename: str | Path) -> dict:
    """Execute a page's block in a fresh namespace; returns the namespace."""
    namespace: dict = {"__name__": "__docs__"}
    exec(compile(code, str(filename), "exec"), namespace)  # noqa: S102 - our own documentation
    return namespace


# -- the blocks and their markers -----------------------------------------------------------------------


def test_every_fence_is_seen():
    """A fence the parser would miss (indented, say inside a list item) would leave its block unchecked."""
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        opening = sum(1 for line in text.splitlines() if line.lstrip().startswith("```"))
        indented = [
            i + 1
            for i, line in enumerate(text.splitlines())
            if line.startswith((" ", "\t")) and line.lstrip().startswith("```")
        ]
        assert not indented, (
            f"{page.relative_to(ROOT)}: fences at lines {indented} are indented; start them at column 0"
        )
        assert opening == 2 * len(blocks(page)), f"{page.relative_to(ROOT)}: a fence without its pair"


def test_markers_are_known_and_name_real_tests():
    for b in ALL_BLOCKS:
        if b.marker is None:
            continue
        assert b.marker in MARKERS, f"{b.where}: unknown marker <!-- {b.marker}: --> (use {' or '.join(MARKERS)})"
        assert b.lang == "python", f"{b.where}: a <!-- {b.marker}: --> marker on a {b.lang or 'plain'} block"
        assert b.note, f"{b.where}: <!-- {b.marker}: --> needs a test name or a reason"
        if b.marker == "tested-by":
            path, _, name = b.note.partition("::")
            test_file = ROOT / path
            assert test_file.is_file(), f"{b.where}: {path} does not exist"
            assert re.search(rf"^def {re.escape(name)}\(", test_file.read_text(), re.M), (
                f"{b.where}: {path} has no test {name}"
            )


def test_blocks_that_do_not_run_are_rare():
    skipped = [b.where for b in ALL_BLOCKS if b.marker == "no-test"]
    assert len(skipped) <= 3, f"too many blocks the tests do not run: {skipped}"


UNTESTED = [b for b in ALL_BLOCKS if b.lang == "python" and b.marker is None]


@pytest.mark.parametrize("block", UNTESTED, ids=[b.where for b in UNTESTED])
def test_python_block_runs(block, tmp_path, monkeypatch):
    """A block no dedicated test runs: it must run as printed (in a temporary folder)."""
    monkeypatch.chdir(tmp_path)
    run_block(block.code, block.page)


# -- command lines --------------------------------------------------------------------------------------


def command_lines() -> list[tuple[str, str]]:
    """(where, line) for every command of every ```bash block, continuation lines joined."""
    lines = []
    for b in ALL_BLOCKS:
        if b.lang not in ("bash", "sh", "shell", "console"):
            continue
        assert b.lang == "bash", f"{b.where}: write shell commands in ```bash blocks (found ```{b.lang})"
        pending, first = "", 0
        for i, line in enumerate(b.code.splitlines()):
            if not pending:
                first = i
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            full, pending = pending + line, ""
            if shlex.split(full, comments=True):
                lines.append((f"{b.page.relative_to(ROOT)}:{b.line + 1 + first}", full))
    return lines


COMMANDS = command_lines()


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {name for names in re.findall(r"^([\w.$()/ -]+?)\s*:(?!=)", text, re.M) for name in names.split()}


def check_k3(argv: list[str], where: str) -> None:
    from k3.cli.parser import build_parser

    try:
        args, rest = build_parser().parse_known_args(argv)
    except SystemExit as e:
        pytest.fail(f"{where}: `k3 {shlex.join(argv)}` does not parse (exit {e.code}, message above)")
    if args.command == "eval":
        check_lm_eval(rest, where)
    else:
        assert not rest, f"{where}: `k3 {shlex.join(argv)}`: k3 does not know {rest}"


def check_lm_eval(argv: list[str], where: str) -> None:
    cli = pytest.importorskip("lm_eval._cli", reason="lm-eval is not installed: pip install 'k3[eval]'")
    parser = cli.HarnessCLI()._parser  # what `lm_eval ARGS` parses (it puts "run" first when no command is named)
    subcommands = {"run", "ls", "validate"}
    try:
        parser.parse_args(argv if argv and argv[0] in subcommands else ["run", *argv])
    except SystemExit as e:
        pytest.fail(f"{where}: lm-eval does not parse {shlex.join(argv)!r} (exit {e.code}, message above)")


@pytest.mark.parametrize("where,line", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_command_line_parses(where, line):
    argv = shlex.split(line, comments=True)
    while argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", argv[0]):  # VAR=value before the command
        argv = argv[1:]
    command, rest = argv[0], argv[1:]
    if command == "torchrun":
        assert "-m" in rest and rest[rest.index("-m") + 1] == "k3", f"{where}: torchrun runs `-m k3` in these pages"
        check_k3(rest[rest.index("-m") + 2 :], where)
    elif command in ("python", "python3") and rest[:1] == ["-m"]:
        module, args = rest[1], rest[2:]
        if module == "k3":
            check_k3(args, where)
        elif module == "k3.eval":
            check_lm_eval(args, where)
        elif module == "k3.plan.simulate":
            assert len(args) in (3, 4) and all(a.isdigit() for a in args[1:]), f"{where}: PRESET N EP [RANK]"
        else:
            pytest.fail(f"{where}: no check for `python -m {module}`; add one to tests/test_docs.py")
    elif command == "k3":
        check_k3(rest, where)
    elif command in ("lm_eval", "lm-eval"):
        check_lm_eval(rest, where)
    elif command == "make":
        targets = [a for a in rest if not a.startswith("-") and "=" not in a]
        missing = set(targets) - makefile_targets()
        assert targets and not missing, f"{where}: the Makefile has no target {sorted(missing) or '(none named)'}"
    else:
        pytest.fail(f"{where}: no check for the command {command!r}; add one to tests/test_docs.py")


def test_k3_commands_are_checked():
    """The pages show commands (a few dozen of them), and a wrong flag fails the check."""
    assert len([1 for _, line in COMMANDS if " k3 " in f" {line}"]) > 30
    with pytest.raises(AssertionError, match="does not know"):
        check_k3(["train", "--no-such-flag"], "here")
    with pytest.raises(pytest.fail.Exception, match="does not parse"):
        check_k3(["train", "--batch-size", "0"], "here")
    with pytest.raises(AssertionError, match="no target"):
        test_command_line_parses("here", "make no-such-target")


# -- links ----------------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def links(page: Path) -> list[str]:
    """The targets of the page's inline links and images, outside code blocks and code spans."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    text = re.sub(r"(`+).*?\1", "", text, flags=re.S)
    return LINK.findall(text)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_point_to_files(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):  # https:, mailto:, an anchor
            continue
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to files that do not exist: {broken}"


def test_the_readme_links_to_every_page():
    """Each topic page is reachable from the README's table (the API pages from the first one)."""
    linked = {(README.parent / t.split("#", 1)[0]).resolve() for t in links(README) if not t.startswith("#")}
    pages = [p for p in (ROOT / "docs").glob("*.md")]
    missing = [str(p.relative_to(ROOT)) for p in pages if p.resolve() not in linked]
    assert not missing, f"the README does not link to {missing}"


# -- dedicated tests of blocks in docs/ -----------------------------------------------------------------


def test_published_checkpoint_block_loads_a_tiny_one(tmp_path):
    """docs/checkpoints.md's four ways to load Kimi K3's published checkpoint, on a tiny one written in
    that layout (tests/models/kimi_k3_files.py)."""
    from .models.kimi_k3_files import tiny_config, write_published

    write_published(tmp_path / "Kimi-K3")
    code = python_block("docs/checkpoints.md", 'experts="mxfp4"')
    assert code.count('"path/to/Kimi-K3"') == 1
    with pytest.warns(UserWarning, match="vision tensors"):  # said once a load: k3 reads the text model
        namespace = run_block(code.replace('"path/to/Kimi-K3"', repr(str(tmp_path / "Kimi-K3"))), "docs/checkpoints.md")
    model = namespace["model"]  # the last one: the shapes on the meta device
    assert next(model.parameters()).is_meta
    assert model.num_parameters() == namespace["CausalLM"](tiny_config()).num_parameters()
