"""`python -m k3.eval ARGS`: lm-eval's command line with the "k3" model registered (see k3.eval.lm_eval.main).
Without the `eval` extra it says so in one line and exits 2, as `k3 eval` does."""

import sys

try:
    from .lm_eval import main
except ModuleNotFoundError as e:
    if e.name is None or not e.name.startswith("lm_eval"):
        raise
    print(
        "python -m k3.eval: error: lm-evaluation-harness is not installed; pip install 'k3[eval]' (or lm-eval)",
        file=sys.stderr,
    )
    sys.exit(2)

sys.exit(main())
