"""Four bridges that let fla's Triton kernels run on CPU tensors under Triton's interpreter
(`TRITON_INTERPRET=1`; ../shared/research/gpu-anchors.md section 3). Test harness only: k3 itself never
patches Triton.

1. The autotuner times its configurations through a GPU driver, and the interpreter has none
   ("0 active drivers"): `Autotuner.prune_configs` keeps the first configuration, so there is nothing to
   time.
2. Inside a kernel the compiler's front end makes the index of `for i in range(n)` a Triton tensor, and
   fla's kernels call methods on it (`i_t.to(tl.int64)`); the interpreter runs the loop as Python, whose
   `range` yields ints. While an interpreted kernel runs, the module globals of the functions the
   interpreter patches hold a `range` that yields int32 Triton tensors; outside a kernel it is Python's.
3. The interpreter re-binds `triton.language`'s builtins (`tl.gather`, ...) to versions that take its
   own semantics, but a module-level alias of one (fla's `gather = tl.gather`, for the safe gate's
   kernels) still names the original, which refuses to run outside a compiled kernel: such aliases in
   the kernel's globals are pointed at the interpreter's versions. (Only an interpreting process
   installs this, and there every kernel is interpreted.)
4. fla's safe-gate kernels ask their dots for `input_precision="bf16x3"` (three bfloat16 products, on
   GPUs with Triton >= 3.6); the interpreter multiplies in float32 whatever is asked, but lists only
   tf32, tf32x3 and ieee as allowed: bf16x3 is added to the list.
"""

from __future__ import annotations

import builtins
import dataclasses
import threading

_state = threading.local()


def _inside_kernel() -> bool:
    return getattr(_state, "depth", 0) > 0


def _as_int(x) -> int:
    """A loop bound: a Python int, or a scalar Triton tensor the interpreter made of one."""
    handle = getattr(x, "handle", None)
    return int(handle.data.item()) if handle is not None else int(x)


class _KernelRange:
    """`range` as the compiler's front end sees it: yields Triton int32 scalars inside a kernel."""

    def __call__(self, *args):
        if not _inside_kernel():
            return builtins.range(*args)
        import numpy as np
        import triton.language as tl
        from triton.runtime.interpreter import TensorHandle

        return (
            tl.core.tensor(TensorHandle(np.array(i, np.int32), tl.int32), tl.int32)
            for i in builtins.range(*(_as_int(a) for a in args))
        )


_KERNEL_RANGE = _KernelRange()


def install() -> None:
    """Apply the four bridges (idempotent). Call after `TRITON_INTERPRET=1` is set and before fla runs."""
    import triton.language as tl
    import triton.runtime.autotuner as autotuner
    import triton.runtime.interpreter as interpreter

    if getattr(interpreter, "_k3_bridged", False):
        return
    interpreter._k3_bridged = True

    def first_config(self, kwargs):
        return self.configs[:1]

    autotuner.Autotuner.prune_configs = first_config

    patch_lang = interpreter._patch_lang

    def patch_lang_and_range(fn):
        scope = patch_lang(fn)
        names = fn.__globals__
        names["range"] = _KERNEL_RANGE  # Python's range outside a kernel (_KernelRange)
        for name, value in list(names.items()):
            if tl.core.is_builtin(value) and value.__module__.startswith("triton.language"):
                names[name] = getattr(tl, value.__name__, value)  # the interpreter's version
        return scope

    interpreter._patch_lang = patch_lang_and_range

    grid_call = interpreter.GridExecutor.__call__

    def counted_call(self, *args, **kwargs):
        _state.depth = getattr(_state, "depth", 0) + 1
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            _state.depth -= 1

    interpreter.GridExecutor.__call__ = counted_call

    builder = interpreter.interpreter_builder
    allowed = builder.options.allowed_dot_input_precisions
    if "bf16x3" not in allowed:
        builder.options = dataclasses.replace(builder.options, allowed_dot_input_precisions=(*allowed, "bf16x3"))
