"""The README's Python example runs as printed and shows what it claims."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def python_block(containing: str) -> str:
    """The README's Python block that contains `containing`."""
    [code] = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if containing in b]
    return code


def test_readme_example_runs():
    """Execute the README's first Python block; the chunk and recurrent KDA it compares must agree."""
    code = python_block("from k3.ops import")
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)  # noqa: S102 - our own README
    o, o_ref = namespace["o"], namespace["o_ref"]
    assert ((o - o_ref).norm() / o_ref.norm()).item() < 5e-4
    assert namespace["o_next"].shape == (1, 1, 4, 64)


def test_readme_models_example_runs():
    """The second Python block: a tiny Kimi K3 with its cache, generation, and Kimi K3 on meta."""
    code = python_block("cache.nbytes_by_type()")
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)  # noqa: S102 - our own README
    assert namespace["out"].shape == (2, 24)
    assert [len(r) for r in namespace["rows"]] == [7, 5, 6]
    assert namespace["step"].shape == (2, 1, namespace["config"].vocab_size)
    assert namespace["k3"].num_parameters() == 2_779_484_393_568


def test_readme_python_api_example_runs(capsys):
    """The training-from-Python block: `from k3 import ...`, train, load the checkpoint, generate."""
    namespace: dict = {}
    exec(compile(python_block("from k3 import"), str(README), "exec"), namespace)  # noqa: S102 - our own README
    assert namespace["history"]["final_val_bpb"] < 1.0  # a 43-byte line repeated: learned well below 8 bits
    assert namespace["tokenizer"].decode(namespace["row"]).startswith("To be, ")
    assert capsys.readouterr().out.rstrip().endswith("kimi-k3-tiny True")


def test_top_level_names_load_lazily():
    """`from k3 import CausalLM` works, and `import k3` alone does not import the models or training."""
    import subprocess
    import sys

    code = ("import sys, k3; assert 'k3.models' not in sys.modules and 'k3.training' not in sys.modules; "
            "from k3 import CausalLM, TrainConfig, get_config, train, count_params; "
            "import k3.models, k3.training; assert CausalLM is k3.models.CausalLM and train is k3.training.train; "
            "print(sorted(n for n in dir(k3) if not n.startswith('_')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "CausalLM" in out and "TrainConfig" in out
