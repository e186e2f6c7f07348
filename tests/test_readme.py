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
