"""llama.cpp, through llama-cpp-python, as the second implementation: its logits for token ids (one prefill,
and token by token through its own cache), its tokenizer, and its own converter (convert_hf_to_gguf.py, from
the llama-cpp-python sdist that `make test-gguf` unpacks; K3_LLAMA_CPP_SOURCE names the folder)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

SOURCE = os.environ.get("K3_LLAMA_CPP_SOURCE", "")

# convert_hf_to_gguf.py recognizes a BPE pre-tokenizer by the hash of a known vocabulary's tokens for a test
# text (new ones are registered in convert_hf_to_gguf_update.py); k3's pre-tokenizer is GPT-2's, so the
# driver says so and leaves everything else to the converter
DRIVER = """
import runpy, sys
sys.path[:0] = [{source!r} + "/gguf-py", {source!r}]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = ["convert_hf_to_gguf.py", {folder!r}, "--outfile", {out!r}, "--outtype", "f32"]
runpy.run_path({source!r} + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def load(path, n_ctx: int = 512):
    from llama_cpp import Llama

    # float32 caches (type_k = type_v = 0, GGML_TYPE_F32): the comparison is of the implementations
    return Llama(
        model_path=str(path),
        n_ctx=n_ctx,
        n_batch=n_ctx,
        logits_all=True,
        n_threads=2,
        verbose=False,
        type_k=0,
        type_v=0,
    )


def prefill_logits(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float64)


def stepwise_logits(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    rows = []
    for t in ids:
        llm.eval([t])
        rows.append(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64))
    return np.stack(rows)


def convert(folder: Path, out: Path) -> Path:
    """llama.cpp's convert_hf_to_gguf.py on an exported folder, in its own interpreter."""
    if not SOURCE or not Path(SOURCE, "convert_hf_to_gguf.py").is_file():
        raise RuntimeError("K3_LLAMA_CPP_SOURCE must name llama.cpp's source folder (make test-gguf sets it)")
    code = DRIVER.format(source=SOURCE, folder=str(folder), out=str(out))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-3000:]}")
    return out
