"""`k3 lab`: the article's claims as measured tables and plots.

Every experiment is a module (a package for the larger ones: what it measures apart from what it writes)
with `run(mode, docs) -> Result` (`k3.lab.report.Result`); `mode` is "smoke" (seconds; what the tests run),
"quick" (`k3 lab all --quick` runs all of them in about 40 minutes on a 2-core CPU) or "full" (the larger
sweeps). In the output folder `docs` (`runs/lab` unless given; the repository's page is `docs/`) figures go
to `figures/`, the result to `lab/NAME.json`, and `results.md` is re-rendered from all saved results. The page's
words are markdown templates, one per experiment (k3/lab/templates/, read by `k3.lab.text`), filled from the
run's numbers.
"""

from __future__ import annotations

import importlib
import time
from pathlib import Path

from .report import Result, claim_folder, machine_summary, save_result, write_results

MODES = ("smoke", "quick", "full")

# name -> (module, what it tests); the order is the order of docs/results.md
EXPERIMENTS: dict[str, tuple[str, str]] = {
    "recall": ("k3.lab.recall", "associative recall (MQAR): accuracy against key-value pairs, per mixer"),
    "overwrite": ("k3.lab.overwrite", "re-bound keys and context switches: who recalls the latest value, who forgets"),
    "prefill": ("k3.lab.prefill", "chunkwise prefill time against the FLOP model 2·L·d² + 2·L·C·d"),
    "decode": ("k3.lab.decode", "per-token decode latency and cache bytes against context length"),
    "parts": ("k3.lab.parts", "K3's parts: SiTU vs SwiGLU, latent vs full-width MoE, AttnRes on and off"),
    "inspect": ("k3.lab.inspect", "what a trained K3 learned: AttnRes weights, expert load, KDA decay, MLA attention"),
    "lineage": ("k3.lab.lineage", "the lineage on language modelling: every model at one width and one time budget"),
}


def run(name: str, mode: str = "quick", docs: str | Path = "runs/lab", **options) -> Result:
    """Run one experiment, save its result and figures under `docs`, and re-render `docs/results.md`."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; choose from: {', '.join(EXPERIMENTS)} (or 'all')")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    docs = Path(docs)
    claim_folder(docs)
    module = importlib.import_module(EXPERIMENTS[name][0])
    start = time.perf_counter()
    result: Result = module.run(mode=mode, docs=docs, **options)
    result.seconds = time.perf_counter() - start
    result.machine = machine_summary()
    save_result(result, docs)
    write_results(docs, list(EXPERIMENTS))
    return result
