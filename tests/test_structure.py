"""The package's structure (README, Layout): imports go one way, with no circle; modules stay small.

Every `import` in k3/, at module level or inside a function, is read with `ast` and resolved to the k3
module it names.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "k3"
# lower layers first: a module may import its own package and anything in a lower layer
LAYERS = [
    {"k3", "k3.io", "k3.tokenizer", "k3.runtime"},
    {"k3.ops"},
    {"k3.layers"},
    # below the models, which delegate to them: inference is duck-typed over the model and its cache
    # (CausalLM's generate, stream and decode_step pass them in); checkpoints take the model's class
    # (from_pretrained passes it; its `config_class` reads config.json) and the model itself
    {"k3.inference", "k3.checkpoints"},
    {"k3.models"},
    {"k3.training", "k3.serve"},
    # below the benchmarks and the lab: the planner prices from structure (k3.ops.cost), never from an
    # experiment; `k3 bench parallel` measures beside it
    {"k3.plan"},
    {"k3.bench", "k3.hf", "k3.eval"},
    {"k3.lab"},
    {"k3.cli"},
    {"k3.__main__"},
]
MAX_LINES = 450
# third-party libraries imported only where their integration lives (bench may time transformers as a peer)
ONLY_IN = {
    "transformers": {"k3.hf", "k3.bench"},
    "lm_eval": {"k3.eval"},
    "fastapi": {"k3.serve"},
    "uvicorn": {"k3.serve"},
}


def modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(k3 modules imported by module `name`, top-level names of the other packages it imports)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    inside, outside = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (
                ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                if node.level
                else node.module or ""
            )
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] != "k3":
                outside.add(target.split(".")[0])
                continue
            while target not in known:
                target = target.rsplit(".", 1)[0]
            if target != name:
                inside.add(target)
    return inside, outside


def package(name: str) -> str:
    return ".".join(name.split(".")[:2])


def layer(name: str) -> int:
    return next(i for i, group in enumerate(LAYERS) if package(name) in group)


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    known = modules()
    edges, external = {}, {}
    for name, path in known.items():
        edges[name], external[name] = imports(name, path, known)
    return edges, external


def test_every_module_is_in_a_layer():
    for name in modules():
        layer(name)  # raises StopIteration for a package missing from LAYERS


def test_imports_go_down_the_layers(graph):
    edges, _ = graph
    upward = [
        f"{a} -> {b}"
        for a, targets in edges.items()
        for b in targets
        if package(a) != package(b) and layer(b) >= layer(a)
    ]
    assert not upward, "imports against the layering: " + ", ".join(sorted(upward))


def test_no_import_circle(graph):
    edges, _ = graph
    index, low, stack, on_stack, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_integrations_are_imported_only_where_they_live(graph):
    _, external = graph
    stray = [
        f"{name} imports {lib}"
        for name, libs in external.items()
        for lib, homes in ONLY_IN.items()
        if lib in libs and package(name) not in homes
    ]
    assert not stray, ", ".join(stray)


def test_modules_stay_small():
    big = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: {big}"


def test_every_cli_command_is_a_module_of_one_interface():
    """`k3`'s commands and `k3 bench`'s: one module each, with `NAME`, `PARSER` (its subparser's keywords),
    `add_arguments(parser)` and `run(args)` (k3.cli.common.Command), put together by `add_command`."""
    import argparse

    from k3.cli.bench import SUBCOMMANDS
    from k3.cli.common import add_command
    from k3.cli.parser import COMMANDS

    for group in (COMMANDS, SUBCOMMANDS):
        names = [command.NAME for command in group]
        assert len(set(names)) == len(names), names
        for command in group:
            assert callable(command.run) and callable(command.add_arguments), command.__name__
            assert isinstance(command.PARSER, dict) and "help" in command.PARSER, command.__name__
            sub = argparse.ArgumentParser().add_subparsers()
            parser = add_command(sub, command)
            assert parser is sub.choices[command.NAME] and parser.get_default("func") is command.run


def test_the_cli_modules_import_no_private_name():
    """A name the command modules of k3.cli share is public (argtypes.py: the argument types; common.py: what
    several commands do as they run): no `from .x import _y` in k3/cli."""
    private = [
        f"{path.relative_to(ROOT.parent)}: {alias.name}"
        for path in sorted((ROOT / "cli").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]
    assert not private, ", ".join(private)
