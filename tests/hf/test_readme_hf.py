"""The README's Hugging Face example runs as printed and shows what it claims."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_hf_example_runs(capsys):
    section = README.read_text().split("## Hugging Face transformers", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)  # noqa: S102 - our own README
    assert capsys.readouterr().out.strip().endswith("True")
    assert namespace["out"].shape == (2, 28)
