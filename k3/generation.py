"""`k3.generation`, the former name of `k3.inference.generation`, kept so code that imports it keeps
working: the name is that very module (`sys.modules`), so what is read or patched through either name is
the same."""

import sys

from .inference import generation as _generation

sys.modules[__name__] = _generation
