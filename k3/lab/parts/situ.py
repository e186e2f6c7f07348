"""SiTU-GLU against SwiGLU: "without a fused kernel, the new activation is almost 3x slower". The
activation alone and the whole gated MLP (`k3.layers.ffn.GatedMLP`), forward and forward + backward, for
three SiTUs (`SITU_VARIANTS`): the article's formula run op by op through autograd
(`k3.layers.ffn.situ_reference`, eager: the unfused SiTU), k3's `situ` (one autograd function with a
hand-derived backward, in-place passes: k3's fused SiTU) and the formula `torch.compile`d (Inductor fuses
the elementwise chain into one loop; SwiGLU is compiled too for its ratio); and what SiTU's parts, tanh
and sigmoid, cost against SiLU's."""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ...bench.timing import interleaved_best, thread_clock
from ...layers.ffn import GatedMLP, situ, situ_reference
from ..text import paragraph
from .cases import forward, forward_backward

SITU_SLOWDOWN = 3.0  # the article (seed 003): "without a fused kernel, the new activation is almost 3x slower"
SHORT_ROUNDS = 4  # cases of a few milliseconds get this many times the rounds: more chances at a quiet moment
# the SiTUs compared with SwiGLU: {variant: (activation, mode)}, each against SwiGLU in the same mode
SITU_VARIANTS = {
    "unfused formula": ("situ formula", "eager"),
    "k3 fused": ("situ fused", "eager"),
    "torch.compile": ("situ formula", "compiled"),
}
FUSED_VARIANTS = ("k3 fused", "torch.compile")
# the verdicts: the unfused slowdown is "almost 3x" within these bounds (partly within the wider ones); a
# fused SiTU removes the slowdown when at most FUSED_HOLDS slower and at most half the unfused excess
ALMOST_3X, ROUGHLY_3X, FUSED_HOLDS = (2.0, 4.0), (1.5, 6.0), 1.5


def _swiglu_activation(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _situ_fused(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return situ(gate, up, beta=4.0, linear_beta=25.0)  # K3's beta and linear beta


def _situ_formula(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return situ_reference(gate, up, beta=4.0, linear_beta=25.0)


class _FormulaMLP(nn.Module):
    """A SiTU GatedMLP's projections around the formula (`situ_reference`) instead of k3's `situ`."""

    def __init__(self, mlp: GatedMLP):
        super().__init__()
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.mlp
        return m.down_proj(situ_reference(m.gate_proj(x), m.up_proj(x), m.situ_beta, m.situ_linear_beta))


def time_activations(
    tokens: int,
    dim: int,
    hidden: int,
    rounds: int,
    compiled: bool,
    notes: list[str],
    compile_seconds: dict[str, float] | None = None,
    seed: int = 0,
) -> dict[tuple[str, str, str, str], float]:
    """Seconds for {(part, activation, pass, mode)}: part "activation" (gate, up [tokens, hidden] -> a * u) or
    "gated MLP" (x [tokens, dim] -> GatedMLP(dim, hidden)), activation "swiglu", "situ formula"
    (`situ_reference`) or "situ fused" (k3's `situ`), pass "fwd"/"fwd+bwd", mode "eager" (all three) or
    "compiled" (SwiGLU and the formula). Compiled entries are missing when torch.compile fails (a note says
    so); the seconds each compilation took go to `compile_seconds`."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, generator=gen, requires_grad=True)
    gate = (2 * torch.randn(tokens, hidden, generator=gen)).requires_grad_()
    up = (2 * torch.randn(tokens, hidden, generator=gen)).requires_grad_()
    torch.manual_seed(seed)
    mlps = {"swiglu": GatedMLP(dim, hidden, "swiglu")}
    mlps["situ fused"] = GatedMLP(dim, hidden, "situ")
    mlps["situ fused"].load_state_dict(mlps["swiglu"].state_dict())
    mlps["situ formula"] = _FormulaMLP(mlps["situ fused"])
    acts = {"swiglu": _swiglu_activation, "situ formula": _situ_formula, "situ fused": _situ_fused}
    fns: dict[tuple[str, str, str], tuple[Callable, tuple]] = {}
    for name in acts:
        fns[("activation", name, "eager")] = (acts[name], (gate, up))
        fns[("gated MLP", name, "eager")] = (mlps[name], (x,))
    if compiled:
        for name in ("swiglu", "situ formula"):
            for part, fn, args in (("activation", acts[name], (gate, up)), ("gated MLP", mlps[name], (x,))):
                try:  # compile now, outside the timing: forward + backward graphs, then the no-grad forward
                    start = time.perf_counter()
                    c = torch.compile(fn, dynamic=False)
                    forward_backward(c, *args)()
                    forward(c, *args)()
                except Exception as e:  # noqa: BLE001 - no C++ compiler, an unsupported platform, ...
                    notes.append(
                        paragraph(
                            "parts",
                            "compile-failed",
                            name=name,
                            part=part,
                            error=type(e).__name__,
                            message=(str(e).splitlines() or [""])[0][:200],
                        )
                    )
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


def time_elementwise(
    tokens: int, hidden: int, rounds: int, compiled: bool, seed: int = 0
) -> dict[tuple[str, str], float]:
    """Forward seconds of f(gate) * up for f in tanh, sigmoid (one transcendental each) and SiLU, eager and
    compiled, {(f, mode)}: what SiTU's parts cost on this machine (compile failures leave entries out)."""
    gen = torch.Generator().manual_seed(seed)
    gate, up = torch.randn(tokens, hidden, generator=gen), torch.randn(tokens, hidden, generator=gen)
    fns = {
        "tanh": lambda g, u: torch.tanh(g) * u,
        "sigmoid": lambda g, u: torch.sigmoid(g) * u,
        "silu": _swiglu_activation,
    }
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
    """SiTU time / SwiGLU time (in the same mode) for every (part, pass, variant of `SITU_VARIANTS`)
    measured for both."""
    out = {}
    for (part, name, pas, mode), t in times.items():
        other = times.get((part, "swiglu", pas, mode))
        for variant, measured in SITU_VARIANTS.items():
            if measured == (name, mode) and other:
                out[(part, pas, variant)] = t / other
    return out


def best_fused(ratios: dict[tuple[str, str, str], float]) -> str | None:
    """The fused variant (`FUSED_VARIANTS`) with the smallest activation forward ratio; None if none ran."""
    got = [v for v in FUSED_VARIANTS if ("activation", "fwd", v) in ratios]
    return min(got, key=lambda v: ratios[("activation", "fwd", v)]) if got else None


def situ_verdicts(ratios: dict[tuple[str, str, str], float]) -> tuple[str, str]:
    """(unfused claim, fused claim) verdicts, from the activation's forward ratios. Unfused, from the
    formula run op by op: "almost 3x" when within ALMOST_3X, "partly" within ROUGHLY_3X, else it does not
    hold. Fused, from the best fused variant (`best_fused`): holds when its slowdown is <= FUSED_HOLDS and
    its excess over 1x at most half the unfused one's, "partly" when it only shrinks the slowdown, "not
    measurable here" when no fused variant ran."""
    eager = ratios[("activation", "fwd", "unfused formula")]
    (lo, hi), (wide_lo, wide_hi) = ALMOST_3X, ROUGHLY_3X
    unfused = "holds" if lo <= eager <= hi else "partly" if wide_lo <= eager <= wide_hi else "does not hold"
    best = best_fused(ratios)
    if best is None:
        return unfused, "not measurable here"
    fused = ratios[("activation", "fwd", best)]
    if fused <= FUSED_HOLDS and fused - 1 <= (eager - 1) / 2:
        return unfused, "holds"
    return unfused, "partly" if fused < eager else "does not hold"
