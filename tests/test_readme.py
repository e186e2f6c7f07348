"""The README's example and the examples the README's topic pages (docs/) carry over from it run as
printed and show what they claim. Each block is found by a string it contains; the line before it
names the test here (`<!-- tested-by: ... -->`), and tests/test_docs.py runs every other block."""

from __future__ import annotations

from .test_docs import README, ROOT, python_block


def test_readme_first_example_runs(capsys):
    """The README's ten lines: a tiny Kimi K3 generates, and the full one is counted on paper."""
    namespace: dict = {}
    exec(compile(python_block(README, 'count_params(get_config("kimi-k3"))'), str(README), "exec"), namespace)  # noqa: S102
    assert namespace["out"].shape == (1, 24)
    assert capsys.readouterr().out.split() == ["torch.Size([1,", "24])", "True", "2779484393568"]


def test_readme_example_runs():
    """docs/ops.md's block: the chunk and recurrent KDA it compares must agree."""
    code = python_block("docs/ops.md", "from k3.ops import")
    namespace: dict = {}
    exec(compile(code, str(ROOT / "docs/ops.md"), "exec"), namespace)  # noqa: S102 - our own docs
    o, o_ref = namespace["o"], namespace["o_ref"]
    assert ((o - o_ref).norm() / o_ref.norm()).item() < 5e-4
    assert namespace["o_next"].shape == (1, 1, 4, 64)


def test_readme_models_example_runs():
    """docs/models.md's first block: a tiny Kimi K3 with its cache, generation, and Kimi K3 on meta."""
    code = python_block("docs/models.md", "cache.nbytes_by_type()")
    namespace: dict = {}
    exec(compile(code, str(ROOT / "docs/models.md"), "exec"), namespace)  # noqa: S102 - our own docs
    assert namespace["out"].shape == (2, 24)
    assert [len(r) for r in namespace["rows"]] == [7, 5, 6]
    assert namespace["step"].shape == (2, 1, namespace["config"].vocab_size)
    assert namespace["k3"].num_parameters() == 2_779_484_393_568


def test_readme_python_api_example_runs(capsys):
    """docs/training.md's training-from-Python block: `from k3 import ...`, train, load the checkpoint, generate."""
    namespace: dict = {}
    code = python_block("docs/training.md", "from k3 import")
    exec(compile(code, str(ROOT / "docs/training.md"), "exec"), namespace)  # noqa: S102 - our own docs
    assert namespace["history"]["final_val_bpb"] < 1.0  # a 43-byte line repeated: learned well below 8 bits
    assert namespace["tokenizer"].decode(namespace["row"]).startswith("To be, ")
    assert capsys.readouterr().out.rstrip().endswith("kimi-k3-tiny True")


def test_top_level_names_load_lazily():
    """`from k3 import CausalLM` works, and `import k3` alone does not import the models or training."""
    import subprocess
    import sys

    code = (
        "import sys, k3; assert 'k3.models' not in sys.modules and 'k3.training' not in sys.modules; "
        "from k3 import CausalLM, TrainConfig, get_config, train, count_params; "
        "import k3.models, k3.training; assert CausalLM is k3.models.CausalLM and train is k3.training.train; "
        "print(sorted(n for n in dir(k3) if not n.startswith('_')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "CausalLM" in out and "TrainConfig" in out
