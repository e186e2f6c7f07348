"""The README's Python example runs as printed and shows what it claims."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs():
    """Execute the README's first Python block; the chunk and recurrent KDA it compares must agree."""
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)  # noqa: S102 - our own README
    o, o_ref = namespace["o"], namespace["o_ref"]
    assert ((o - o_ref).norm() / o_ref.norm()).item() < 5e-4
    assert namespace["o_next"].shape == (1, 1, 4, 64)


def test_readme_models_example_runs():
    """The second Python block: a tiny Kimi K3 with its cache, generation, and Kimi K3 on meta."""
    code = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[1]
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)  # noqa: S102 - our own README
    assert namespace["out"].shape == (2, 24)
    assert [len(r) for r in namespace["rows"]] == [7, 5, 6]
    assert namespace["step"].shape == (2, 1, namespace["config"].vocab_size)
    assert namespace["k3"].num_parameters() == 2_779_484_393_568
