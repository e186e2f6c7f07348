"""Evaluation with EleutherAI's lm-evaluation-harness: `k3.eval.lm_eval.K3LM` is the model adapter
(lm-eval's name for it: "k3"); `k3 eval ...` / `python -m k3.eval ...` run lm-eval's command line with
it registered. Needs the `eval` extra (`pip install k3[eval]`); importing this package alone does not."""
