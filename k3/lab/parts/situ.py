"""SiTU-GLU against SwiGLU: "without a fused kernel, the new activation is almost 3x slower". The
activation alone and the whole gated MLP (`k3.layers.ffn.GatedMLP`), forward and forward + backward,
eager (one kernel per elementwise op) and `torch.compile`d (Inductor fuses the elementwise chain into
one loop: the "fused kernel"); and what SiTU's parts, tanh and sigmoid, cost against SiLU's."""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F

from ...bench.timing import interleaved_best, thread_clock
from ...layers.ffn import GatedMLP, situ
from .cases import forward, forward_backward

SITU_SLOWDOWN = 3.0  # the article (seed 003): "without a fused kernel, the new activation is almost 3x slower"
SHORT_ROUNDS = 4  # cases of a few milliseconds get this many times the rounds: more chances at a quiet moment


def _swiglu_activation(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _situ_activation(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return situ(gate, up, beta=4.0, linear_beta=25.0)  # K3's beta and linear beta


def time_activations(tokens: int, dim: int, hidden: int, rounds: int, compiled: bool, notes: list[str],
                     compile_seconds: dict[str, float] | None = None, seed: int = 0
                     ) -> dict[tuple[str, str, str, str], float]:
    """Seconds for {(part, activation, pass, mode)}: part "activation" (gate, up [tokens, hidden] -> a * u) or
    "gated MLP" (x [tokens, dim] -> GatedMLP(dim, hidden)), activation "situ"/"swiglu", pass "fwd"/"fwd+bwd",
    mode "eager"/"compiled". Compiled entries are missing when torch.compile fails (a note says so); the
    seconds each compilation took go to `compile_seconds`."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, generator=gen, requires_grad=True)
    gate = (2 * torch.randn(tokens, hidden, generator=gen)).requires_grad_()
    up = (2 * torch.randn(tokens, hidden, generator=gen)).requires_grad_()
    torch.manual_seed(seed)
    mlps = {"swiglu": GatedMLP(dim, hidden, "swiglu")}
    mlps["situ"] = GatedMLP(dim, hidden, "situ")
    mlps["situ"].load_state_dict(mlps["swiglu"].state_dict())
    acts = {"swiglu": _swiglu_activation, "situ": _situ_activation}
    fns: dict[tuple[str, str, str], tuple[Callable, tuple]] = {}
    for name in ("swiglu", "situ"):
        fns[("activation", name, "eager")] = (acts[name], (gate, up))
        fns[("gated MLP", name, "eager")] = (mlps[name], (x,))
    if compiled:
        for name in ("swiglu", "situ"):
            for part, fn, args in (("activation", acts[name], (gate, up)), ("gated MLP", mlps[name], (x,))):
                try:  # compile now, outside the timing: forward + backward graphs, then the no-grad forward
                    start = time.perf_counter()
                    c = torch.compile(fn, dynamic=False)
                    forward_backward(c, *args)()
                    forward(c, *args)()
                except Exception as e:  # noqa: BLE001 - no C++ compiler, an unsupported platform, ...
                    notes.append(f"torch.compile of the {name} {part} failed ({type(e).__name__}: "
                                 f"{(str(e).splitlines() or [''])[0][:200]}); its compiled figures are omitted")
                    continue
                if compile_seconds is not None:
                    compile_seconds[f"{name} {part}"] = round(time.perf_counter() - start, 1)
                fns[(part, name, "compiled")] = (c, args)
    times = {}
    for which, n in (("activation", SHORT_ROUNDS * rounds), ("gated MLP", rounds)):
        cases = {}
        for (part, name, mode), (fn, args) in fns.items():
            if part == which:
                cases[(part, name, "fwd", mode)] = forward(fn, *args)
                cases[(part, name, "fwd+bwd", mode)] = forward_backward(fn, *args)
        times.update(interleaved_best(cases, n, warmup="ahead", grad=True, clock=thread_clock))
    return times


def time_elementwise(tokens: int, hidden: int, rounds: int, compiled: bool, seed: int = 0
                     ) -> dict[tuple[str, str], float]:
    """Forward seconds of f(gate) * up for f in tanh, sigmoid (one transcendental each) and SiLU, eager and
    compiled, {(f, mode)}: what SiTU's parts cost on this machine (compile failures leave entries out)."""
    gen = torch.Generator().manual_seed(seed)
    gate, up = torch.randn(tokens, hidden, generator=gen), torch.randn(tokens, hidden, generator=gen)
    fns = {"tanh": lambda g, u: torch.tanh(g) * u, "sigmoid": lambda g, u: torch.sigmoid(g) * u,
           "silu": _swiglu_activation}
    cases = {(name, "eager"): forward(fn, gate, up) for name, fn in fns.items()}
    for name, fn in fns.items() if compiled else []:
        try:
            c = torch.compile(fn, dynamic=False)
            forward(c, gate, up)()
        except Exception:  # noqa: BLE001 - time_activations' notes already say why compiling fails here
            continue
        cases[(name, "compiled")] = forward(c, gate, up)
    return interleaved_best(cases, SHORT_ROUNDS * rounds, warmup="ahead", grad=True, clock=thread_clock)


def situ_ratios(times: dict[tuple[str, str, str, str], float]) -> dict[tuple[str, str, str], float]:
    """SiTU time / SwiGLU time for every (part, pass, mode) measured for both."""
    out = {}
    for (part, name, pas, mode), t in times.items():
        other = times.get((part, "swiglu", pas, mode))
        if name == "situ" and other:
            out[(part, pas, mode)] = t / other
    return out


def situ_verdicts(ratios: dict[tuple[str, str, str], float]) -> tuple[str, str]:
    """(unfused claim, fused claim) verdicts. Unfused: the eager activation's forward slowdown is "almost
    3x" when in [2, 4], "partly" when in [1.5, 6], else it does not hold. Fused: compiling closes the gap
    when the compiled forward slowdown is <= 1.5x and its excess over 1x at most half the eager one's
    ("partly" when it only shrinks), "not measurable here" without torch.compile."""
    eager = ratios[("activation", "fwd", "eager")]
    unfused = "holds" if 2.0 <= eager <= 4.0 else "partly" if 1.5 <= eager <= 6.0 else "does not hold"
    compiled = ratios.get(("activation", "fwd", "compiled"))
    if compiled is None:
        return unfused, "not measurable here"
    if compiled <= 1.5 and compiled - 1 <= (eager - 1) / 2:
        return unfused, "holds"
    return unfused, "partly" if compiled < eager else "does not hold"
