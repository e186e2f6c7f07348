"""Makes `lm_eval --model k3 ...` work: registers k3's lm-evaluation-harness adapter under "k3".

lm-eval (0.4.11 to 0.5.0.dev1) resolves `--model NAME` in a registry that only its own model list
(`lm_eval.models.MODEL_MAPPING`) and imported `@register_model` classes fill; it reads no entry
points. The k3 wheel therefore installs `k3_lm_eval.pth` next to this module, and Python's `site`
runs it at start-up: it puts a finder in front of `sys.meta_path` that does nothing until
`lm_eval.models` is imported, then adds "k3" to lm-eval's registry as the lazy placeholder
"k3.eval.lm_eval:K3LM". Nothing is imported early: not lm-eval, not k3, not torch; the adapter loads
only when a run asks for `--model k3`. A registration already there (lm-eval's own plugin discovery,
EleutherAI/lm-evaluation-harness#4013, reads k3's `lm_eval.models` entry point) is left alone.

Set K3_LM_EVAL_PLUGIN=0 to switch it off. Standalone on purpose: importing `k3` at every interpreter
start-up would be wasteful.
"""

import importlib.abc
import os
import sys

ADAPTER = "k3.eval.lm_eval:K3LM"
TARGET = "lm_eval.models"


def register() -> None:
    """Add the "k3" placeholder to lm-eval's model registry, unless something registered it already."""
    from lm_eval.api.registry import model_registry

    if "k3" not in model_registry:
        model_registry.register("k3", target=ADAPTER)


class _RegisterAfter(importlib.abc.Loader):
    """Runs `lm_eval.models` with its own loader, then `register`; everything else is the inner loader's."""

    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        try:
            register()
        except Exception as error:  # never let the hook break lm-eval itself
            print(f"k3: could not register the 'k3' model with lm-eval: {error!r}", file=sys.stderr)

    def __getattr__(self, name):  # get_source, get_filename, is_package ...: tracebacks and inspect
        return getattr(self.inner, name)


class LmEvalModelsFinder(importlib.abc.MetaPathFinder):
    """Asks the finders behind it for `lm_eval.models` and wraps the loader in `_RegisterAfter`."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _RegisterAfter(spec.loader)
                return spec
        return None


def install() -> None:
    """Put the finder first on `sys.meta_path` (once), unless K3_LM_EVAL_PLUGIN=0."""
    if os.environ.get("K3_LM_EVAL_PLUGIN", "1") == "0":
        return
    if not any(isinstance(finder, LmEvalModelsFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, LmEvalModelsFinder())
