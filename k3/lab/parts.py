"""`k3 lab parts`: what K3's own parts cost, beside the article's figures.

Three claims, each measured side by side in one run:

- SiTU-GLU vs SwiGLU: "without a fused kernel, the new activation is almost 3x slower". The activation
  alone and the whole gated MLP (`k3.layers.ffn.GatedMLP`), forward and forward + backward, eager (one
  kernel per elementwise op) and `torch.compile`d (Inductor fuses the elementwise chain into one loop:
  the "fused kernel").
- Latent MoE vs a full-width MoE with the same experts and top-k: "the experts operate in a compressed
  latent space, which ... nearly halves the FLOPs". FLOPs per token on paper at K3's size (`moe_flops`),
  and the forward time of both at a small size with K3's proportions.
- Block Attention Residuals on vs off: "AttnRes adds roughly 2% inference latency". kimi-k3-tiny with
  and without `attn_res_block_size`: prefill and per-token decode latency, parameters; on paper at K3's
  size, AttnRes' parameters and FLOPs per token (`attn_res_flops`).

Timings run torch on one thread and read that thread's CPU time (`time.thread_time`: on a quiet machine
the wall time, on a busy one without the time the thread spent waiting for a core); they interleave the
candidates round after round and keep each one's best round. The figures that matter are the ratios.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ..layers.ffn import GatedMLP, situ
from ..layers.moe import MoE
from ..models import CausalLM, ModelConfig, get_config
from ..models.model import attn_res_source_counts
from ..models.params import count_params
from . import plots, report
from .report import Claim, Figure, Result, Table

# the article's figures (seed 003) that the verdicts are measured against
SITU_SLOWDOWN = 3.0  # "without a fused kernel, the new activation is almost 3x slower"
ATTN_RES_LATENCY = 0.02  # "AttnRes adds roughly 2% inference latency"
PHASES = ("prefill", "decode")
SHORT_ROUNDS = 4  # cases of a few milliseconds get this many times the rounds: more chances at a quiet moment
TIMING_THREADS = 1
clock = time.thread_time  # CPU seconds of the calling thread, which runs every op when torch has one thread

SIZES = {  # per mode: SiTU MLP (tokens, width, hidden), MoE at K3's proportions, AttnRes lengths, rounds
    "smoke": dict(ffn=(64, 32, 96), moe=dict(tokens=64, dim=64, latent=32, hidden=32, experts=8, top_k=4),
                  prefill=16, decode_prompt=4, decode_steps=2, rounds=1, attn_res_widths=(32,)),
    "quick": dict(ffn=(2048, 256, 768), moe=dict(tokens=512, dim=512, latent=256, hidden=224, experts=64, top_k=16),
                  prefill=256, decode_prompt=64, decode_steps=16, rounds=7, attn_res_widths=(192, 512)),
    "full": dict(ffn=(4096, 512, 1536), moe=dict(tokens=1024, dim=512, latent=256, hidden=224, experts=64, top_k=16),
                 prefill=512, decode_prompt=256, decode_steps=32, rounds=15, attn_res_widths=(192, 512, 1024)),
}


# -- timing ------------------------------------------------------------------------------------------
def interleaved_best(cases: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Best time (seconds of `clock`) of each case over `rounds` rounds; every round runs each case once,
    after one untimed warm-up call each. Gradients are left on: a case that only infers wraps itself in
    no_grad."""
    for fn in cases.values():
        fn()
    best = {name: math.inf for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            start = clock()
            fn()
            best[name] = min(best[name], clock() - start)
    return best


def _forward(fn: Callable, *args) -> Callable[[], object]:
    def run():
        with torch.no_grad():
            return fn(*args)
    return run


def _forward_backward(fn: Callable, *args) -> Callable[[], object]:
    def run():
        for a in args:
            a.grad = None
        fn(*args).sum().backward()
    return run


# -- SiTU-GLU against SwiGLU -------------------------------------------------------------------------
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
                    _forward_backward(c, *args)()
                    _forward(c, *args)()
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
                cases[(part, name, "fwd", mode)] = _forward(fn, *args)
                cases[(part, name, "fwd+bwd", mode)] = _forward_backward(fn, *args)
        times.update(interleaved_best(cases, n))
    return times


def time_elementwise(tokens: int, hidden: int, rounds: int, compiled: bool, seed: int = 0
                     ) -> dict[tuple[str, str], float]:
    """Forward seconds of f(gate) * up for f in tanh, sigmoid (one transcendental each) and SiLU, eager and
    compiled, {(f, mode)}: what SiTU's parts cost on this machine (compile failures leave entries out)."""
    gen = torch.Generator().manual_seed(seed)
    gate, up = torch.randn(tokens, hidden, generator=gen), torch.randn(tokens, hidden, generator=gen)
    fns = {"tanh": lambda g, u: torch.tanh(g) * u, "sigmoid": lambda g, u: torch.sigmoid(g) * u,
           "silu": _swiglu_activation}
    cases = {(name, "eager"): _forward(fn, gate, up) for name, fn in fns.items()}
    for name, fn in fns.items() if compiled else []:
        try:
            c = torch.compile(fn, dynamic=False)
            _forward(c, gate, up)()
        except Exception:  # noqa: BLE001 - time_activations' notes already say why compiling fails here
            continue
        cases[(name, "compiled")] = _forward(c, gate, up)
    return interleaved_best(cases, SHORT_ROUNDS * rounds)


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


# -- latent MoE against a full-width MoE -------------------------------------------------------------
def moe_flops(dim: int, hidden: int, num_experts: int, top_k: int, latent: int | None = None,
              num_shared: int = 0) -> dict[str, int]:
    """FLOPs per token of one MoE layer (a multiply-add is 2 FLOPs; elementwise work left out):

        router              2 d E                         (scores for all E experts)
        latent projections  2 (2 d L)                     (down d -> L and up L -> d; latent MoE only)
        routed experts      k * 3 * 2 e I                 (gate, up, down of the k chosen; e = L or d)
        shared experts      3 * 2 d (n_shared I)          (at full width d in both)
    """
    for name, value in (("dim", dim), ("hidden", hidden), ("num_experts", num_experts), ("top_k", top_k)):
        if value < 1:
            raise ValueError(f"moe_flops: `{name}` must be >= 1, got {value}")
    if latent is not None and latent < 1:
        raise ValueError(f"moe_flops: `latent` must be None or >= 1, got {latent}")
    width = dim if latent is None else latent
    return {"router": 2 * dim * num_experts,
            "latent projections": 0 if latent is None else 4 * dim * latent,
            "routed experts": top_k * 6 * width * hidden,
            "shared experts": 6 * dim * num_shared * hidden}


def moe_flop_ratios(dim: int, hidden: int, num_experts: int, top_k: int, latent: int,
                    num_shared: int = 0) -> dict[str, float]:
    """Latent / full-width FLOPs per token (see `moe_flops`): the routed experts alone, the routed path
    (experts + latent projections) and the whole layer (router and shared experts too)."""
    lat = moe_flops(dim, hidden, num_experts, top_k, latent, num_shared)
    full = moe_flops(dim, hidden, num_experts, top_k, None, num_shared)
    return {"routed experts": lat["routed experts"] / full["routed experts"],
            "routed path": _routed(lat) / _routed(full),
            "MoE layer": sum(lat.values()) / sum(full.values())}


def _routed(flops: dict[str, int]) -> int:
    return flops["routed experts"] + flops["latent projections"]


def time_moe(tokens: int, dim: int, latent: int, hidden: int, experts: int, top_k: int, rounds: int,
             seed: int = 0) -> dict[str, float]:
    """Forward seconds of a latent and a full-width MoE (same E, top-k, expert width; no shared experts,
    so only the routed path differs) on the same [tokens, dim] input, routed alike (one router's weights)."""
    torch.manual_seed(seed)
    layers = {"latent": MoE(dim, experts, top_k, hidden, num_shared=0, latent_dim=latent, activation="situ"),
              "full width": MoE(dim, experts, top_k, hidden, num_shared=0, latent_dim=None, activation="situ")}
    layers["full width"].router.load_state_dict(layers["latent"].router.state_dict())  # the same routing
    x = torch.randn(tokens, dim, generator=torch.Generator().manual_seed(seed))
    return interleaved_best({name: _forward(m, x) for name, m in layers.items()}, rounds)


# -- Block Attention Residuals on and off ------------------------------------------------------------
def attn_res_flops(config: ModelConfig) -> int:
    """AttnRes FLOPs per token: each mix over N sources of width d costs ~6 N d (the query dot product and
    the mean square per source, 2d each, then the weighted sum, 2d each); softmax over N is left out."""
    return sum(6 * n * config.hidden_size for n in attn_res_source_counts(config))


def time_attn_res(config: ModelConfig, prefill: int, decode_prompt: int, decode_steps: int, rounds: int,
                  seed: int = 0) -> dict[tuple[str, str], float]:
    """{(variant, phase): seconds} for `config` with AttnRes ("on") and without ("off"): "prefill" is one
    cached forward of `prefill` tokens, "decode" the mean time of one token over `decode_steps` steps after
    a `decode_prompt`-token prompt. Both models share every weight but the AttnRes queries."""
    torch.manual_seed(seed)
    models = {"on": CausalLM(config).eval()}
    models["off"] = CausalLM(config.replace(attn_res_block_size=None)).eval()
    models["off"].load_state_dict(models["on"].state_dict(), strict=False)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (1, max(prefill, decode_prompt + decode_steps)), generator=gen)

    def prefill_case(model):
        return _forward(lambda: model(ids[:, :prefill], cache=model.new_cache(1)))

    @torch.no_grad()
    def decode_step_seconds(model) -> float:
        cache = model.new_cache(1)
        model(ids[:, :decode_prompt], cache=cache)
        start = clock()
        for t in range(decode_prompt, decode_prompt + decode_steps):
            model(ids[:, t:t + 1], cache=cache)
        return (clock() - start) / decode_steps

    best = interleaved_best({(name, "prefill"): prefill_case(m) for name, m in models.items()}, rounds)
    for model in models.values():  # warm-up
        decode_step_seconds(model)
    for _ in range(rounds):  # the prompt is not timed, so these rounds interleave by hand
        for name, model in models.items():
            best[(name, "decode")] = min(best.get((name, "decode"), math.inf), decode_step_seconds(model))
    return best


def attn_res_verdict(overheads: list[float]) -> str:
    """Latency overhead of AttnRes (on / off - 1, per phase): "roughly 2%" holds when every phase is within
    5%, partly when every phase is within 15%, else it does not hold."""
    worst = max(overheads)
    return "holds" if worst <= 0.05 else "partly" if worst <= 0.15 else "does not hold"


# -- the experiment ----------------------------------------------------------------------------------
@contextmanager
def torch_threads(n: int):
    """Run torch ops on `n` threads inside the block (the previous count is restored)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run(mode: str, docs: Path, **options) -> Result:
    """Time SiTU against SwiGLU, the latent against a full-width MoE, AttnRes on against off (see the
    module docstring), on one thread: the figures are ratios, a one-thread pool cannot stall waiting for
    a core that a busy machine gave away (two threads on a shared 2-core machine made tiny ops 100x
    slower in our runs), and one thread's CPU time leaves out the waits."""
    if options:
        raise ValueError(f"k3 lab parts takes no options, got {sorted(options)}")
    if mode not in SIZES:
        raise ValueError(f"k3 lab parts: `mode` must be one of {tuple(SIZES)}, got {mode!r}")
    with torch_threads(TIMING_THREADS):
        return _run(mode, Path(docs))


def _run(mode: str, docs: Path) -> Result:
    s = SIZES[mode]
    rounds = s["rounds"]
    notes = ["Times are the CPU time of the one thread torch runs on (time.thread_time): the wall time on a "
             "quiet machine, and on a busy one without the moments the thread waited for a core; best of the "
             "interleaved rounds"]
    tables: list[Table] = []
    figures: list[Figure] = []
    claims: list[Claim] = []

    # SiTU-GLU against SwiGLU
    tokens, dim, hidden = s["ffn"]
    compiled = mode != "smoke"
    compile_seconds: dict[str, float] = {}
    times = time_activations(tokens, dim, hidden, rounds, compiled, notes, compile_seconds)
    ratios = situ_ratios(times)
    if not compiled:
        notes.append("smoke mode skips torch.compile (it takes tens of seconds): no compiled figures")
    rows = []
    for part in ("activation", "gated MLP"):
        for mode_ in ("eager", "compiled"):
            for pas in ("fwd", "fwd+bwd"):
                if (part, pas, mode_) in ratios:
                    rows.append([part, mode_, pas, 1e3 * times[(part, "swiglu", pas, mode_)],
                                 1e3 * times[(part, "situ", pas, mode_)], ratios[(part, pas, mode_)]])
    tables.append(Table(f"SiTU-GLU against SwiGLU: {tokens} tokens, width {dim}, hidden {hidden}, float32; best of "
                        f"{SHORT_ROUNDS * rounds} (activation) or {rounds} (MLP) interleaved rounds",
                        ["part", "mode", "pass", "SwiGLU ms", "SiTU ms", "SiTU / SwiGLU"], rows))
    unfused, fused = situ_verdicts(ratios)
    claims.append(Claim(
        f"SiTU: \"without a fused kernel, the new activation is almost {SITU_SLOWDOWN:g}x slower\"",
        _situ_measured(ratios, "eager"), unfused))
    claims.append(Claim("SiTU: a fused kernel removes the slowdown (the article: it needs one)",
                        _situ_measured(ratios, "compiled"), fused))
    if compile_seconds:
        notes.append("torch.compile took " + ", ".join(f"{v:.0f} s ({k})" for k, v in compile_seconds.items())
                     + ": compiled once per variant, before the timing")
    notes.append(f"SiTU verdicts: \"almost {SITU_SLOWDOWN:g}x\" holds when the eager activation forward is "
                 "2-4x slower than SwiGLU's (partly: 1.5-6x); the fused claim holds when the compiled "
                 "slowdown is <= 1.5x and its excess over 1x at most half the eager one's (partly: when it only "
                 "shrinks). In the whole MLP the three matmuls dilute the activation's cost")
    notes.append("Why fusing helps less on a CPU than on a GPU: on a GPU these elementwise ops are memory-bound, "
                 "so one fused pass costs about what SwiGLU's does; on a CPU core they are compute-bound, and "
                 "SiTU evaluates two tanh and a sigmoid per element where SiLU evaluates one sigmoid, which no "
                 "fusion removes (the table of f(gate) * up: what one tanh costs against one sigmoid here)")
    elementwise = time_elementwise(tokens, hidden, rounds, compiled)
    tables.append(Table(f"What SiTU's parts cost here: f(gate) * up on [{tokens}, {hidden}], forward, ms, best "
                        f"of {SHORT_ROUNDS * rounds} rounds (SiTU computes two tanh and a sigmoid per element, "
                        "SwiGLU one SiLU)",
                        ["f", "eager ms", "compiled ms"],
                        [[name, 1e3 * elementwise[(name, "eager")],
                          1e3 * elementwise[(name, "compiled")] if (name, "compiled") in elementwise else "-"]
                         for name in ("tanh", "sigmoid", "silu")]))
    _situ_figure(docs / "figures" / "parts_situ.png", ratios)
    figures.append(Figure("figures/parts_situ.png", "SiTU-GLU time / SwiGLU time, eager and torch.compile'd "
                                                    "(fused); the dashed line is the article's 3x"))

    # latent MoE against a full-width MoE
    k3 = get_config("kimi-k3")
    args = (k3.hidden_size, k3.moe_intermediate_size, k3.num_experts, k3.num_experts_per_tok)
    k3_ratios = moe_flop_ratios(*args, k3.moe_latent_size, k3.num_shared_experts)
    k3_lat = moe_flops(*args, k3.moe_latent_size, k3.num_shared_experts)
    k3_full = moe_flops(*args, None, k3.num_shared_experts)
    tables.append(Table(
        f"MoE FLOPs per token at K3's size (d {k3.hidden_size}, latent {k3.moe_latent_size}, expert width "
        f"{k3.moe_intermediate_size}, top-{k3.num_experts_per_tok} of {k3.num_experts}, {k3.num_shared_experts} "
        f"shared at full width), GFLOPs", ["component", "latent MoE (K3)", "full width", "latent / full"],
        [[name, k3_lat[name] / 1e9, k3_full[name] / 1e9,
          (k3_lat[name] / k3_full[name]) if k3_full[name] else "-"] for name in k3_lat]
        + [["MoE layer", sum(k3_lat.values()) / 1e9, sum(k3_full.values()) / 1e9, k3_ratios["MoE layer"]]]))
    m = s["moe"]
    small_args = (m["dim"], m["hidden"], m["experts"], m["top_k"])
    small_ratio = moe_flop_ratios(*small_args, m["latent"])["routed path"]
    moe_times = time_moe(m["tokens"], m["dim"], m["latent"], m["hidden"], m["experts"], m["top_k"], rounds)
    moe_time_ratio = moe_times["latent"] / moe_times["full width"]
    tables.append(Table(
        f"MoE forward time at a small size with K3's proportions ({m['tokens']} tokens, d {m['dim']}, latent "
        f"{m['latent']}, expert width {m['hidden']}, top-{m['top_k']} of {m['experts']}, SiTU experts, no shared "
        f"experts), best of {rounds} interleaved rounds",
        ["variant", "ms", "routed-path GFLOPs (model)", "time ratio", "FLOP ratio"],
        [["full width", 1e3 * moe_times["full width"],
          m["tokens"] * _routed(moe_flops(*small_args)) / 1e9, 1.0, 1.0],
         ["latent", 1e3 * moe_times["latent"],
          m["tokens"] * _routed(moe_flops(*small_args, m["latent"])) / 1e9,
          moe_time_ratio, small_ratio]]))
    path_ratio = k3_ratios["routed path"]
    moe_verdict = "holds" if path_ratio <= 0.6 else "partly" if path_ratio <= 0.8 else "does not hold"
    claims.append(Claim(
        "latent MoE: the experts run in a compressed latent space, which \"nearly halves the FLOPs\"",
        f"at K3's size the routed experts take {k3_ratios['routed experts']:.2f}x the full-width FLOPs, "
        f"{path_ratio:.2f}x with the latent down/up projections, {k3_ratios['MoE layer']:.2f}x for the whole "
        f"MoE layer (shared experts, router); measured time {moe_time_ratio:.2f}x at a small size "
        f"(FLOP model {small_ratio:.2f}x)", moe_verdict))
    notes.append("MoE verdict: from the routed path's FLOP ratio at K3's size (experts + the latent projections "
                 "that the latent space costs): holds <= 0.6, partly <= 0.8. The shared experts run at full "
                 "width in the public config (the article draws them latent too), which is why the whole "
                 "layer saves less. The latent MoE also halves every expert's parameters "
                 f"({3 * k3.moe_latent_size * k3.moe_intermediate_size:,} instead of "
                 f"{3 * k3.hidden_size * k3.moe_intermediate_size:,})")
    notes.append("The measured MoE time follows the FLOP ratio only roughly: k3 dispatches experts in a Python "
                 "loop (one small matmul triple per used expert), whose fixed cost per expert is the same for "
                 "both variants")

    # AttnRes on against off
    widths = s["attn_res_widths"]
    measured = []  # (config, times, overheads) per width
    for width in widths:
        cfg = get_config("kimi-k3-tiny", hidden_size=width)
        ar = time_attn_res(cfg, s["prefill"], s["decode_prompt"], s["decode_steps"], rounds)
        measured.append((cfg, ar, {phase: ar[("on", phase)] / ar[("off", phase)] - 1 for phase in PHASES}))
    tiny = measured[-1][0]
    tables.append(Table(
        f"AttnRes on against off: kimi-k3-tiny ({tiny.num_layers} layers, block {tiny.attn_res_block_size}) at "
        f"width d, prefill of {s['prefill']} tokens, decode after {s['decode_prompt']} (mean of "
        f"{s['decode_steps']} steps), batch 1, best of {rounds} interleaved rounds",
        ["d", "phase", "off ms", "on ms", "overhead"],
        [[cfg.hidden_size, phase, 1e3 * ar[("off", phase)], 1e3 * ar[("on", phase)], f"{100 * over[phase]:+.1f}%"]
         for cfg, ar, over in measured for phase in PHASES]))
    paper = [(f"kimi-k3-tiny (d {cfg.hidden_size})", cfg) for cfg, _, _ in measured] + [("kimi-k3", k3)]
    rows = []
    for name, cfg in paper:
        on, off = count_params(cfg), count_params(cfg.replace(attn_res_block_size=None))
        rows.append([name, f"{off.total:,}", f"{on.total - off.total:,}",
                     f"{100 * (on.total - off.total) / on.total:.5f}%", f"{attn_res_flops(cfg):,}",
                     f"{100 * attn_res_flops(cfg) / (2 * on.active):.4f}%"])
    tables.append(Table(
        "AttnRes parameters and FLOPs per token on paper (~6·N·d FLOPs per mix over N sources, against "
        "2 x the active parameters of the model)",
        ["model", "parameters without", "AttnRes parameters", "share", "AttnRes FLOPs / token", "share of FLOPs"],
        rows))
    k3_on, k3_off = count_params(k3), count_params(k3.replace(attn_res_block_size=None))
    over = measured[-1][2]
    claims.append(Claim(
        f"AttnRes \"adds roughly {100 * ATTN_RES_LATENCY:g}% inference latency\"",
        "; ".join(f"d {cfg.hidden_size}: prefill {100 * o['prefill']:+.1f}%, decode {100 * o['decode']:+.1f}%"
                  for cfg, _, o in measured)
        + f" (kimi-k3-tiny); on paper at K3's size {100 * attn_res_flops(k3) / (2 * k3_on.active):.3f}% of "
        f"the FLOPs and {100 * (k3_on.total - k3_off.total) / k3_on.total:.5f}% of the parameters",
        attn_res_verdict(list(over.values()))))
    notes.append(f"AttnRes verdict: from the measured overheads of the widest model (d {tiny.hidden_size}, the "
                 "closest to K3): holds when prefill and decode are both within +5%, partly within +15%. On paper "
                 "AttnRes is a rounding error in FLOPs and parameters at K3's size; its latency is the extra "
                 "small ops per sub-layer (a logit per source, a softmax over sources, a weighted sum reading "
                 f"every block sum), which weigh more in a {tiny.num_layers}-layer model of width "
                 f"{tiny.hidden_size} on a CPU than in K3's {k3.num_layers} layers of width {k3.hidden_size}")
    _attn_res_figure(docs / "figures" / "parts_attnres.png", measured, k3)
    figures.append(Figure("figures/parts_attnres.png", "AttnRes latency overhead in kimi-k3-tiny at several "
                                                       "widths (left); sources each K3 AttnRes mix reads (right)"))
    _moe_figure(docs / "figures" / "parts_moe.png", k3_lat, k3_full, moe_times, small_ratio)
    figures.append(Figure("figures/parts_moe.png", "MoE FLOPs per token at K3's size, latent against full width "
                                                   "(left); measured forward time at a small size (right)"))
    if compiled:
        from torch import _dynamo

        _dynamo.reset()  # free the compiled graphs
    setup = dict(seed=0, threads=TIMING_THREADS, clock="time.thread_time", rounds=rounds, dtype="float32",
                 situ=dict(tokens=tokens, dim=dim, hidden=hidden, beta=4.0, linear_beta=25.0, compiled=compiled),
                 moe_small=m, attn_res=dict(preset="kimi-k3-tiny", widths=widths,
                                            prefill=s["prefill"], decode_prompt=s["decode_prompt"],
                                            decode_steps=s["decode_steps"]))
    return Result(name="parts", title="K3's parts: SiTU, the latent MoE and AttnRes", mode=mode,
                  command=report.command("parts", mode), claims=claims, tables=tables, figures=figures, notes=notes,
                  setup=setup)


def _situ_measured(ratios: dict[tuple[str, str, str], float], mode: str) -> str:
    """'activation 3.1x (fwd), 2.5x (fwd+bwd); gated MLP ...' for the ratios measured in `mode`."""
    parts = []
    for part in ("activation", "gated MLP"):
        got = [f"{ratios[(part, pas, mode)]:.2f}x ({pas})" for pas in ("fwd", "fwd+bwd") if (part, pas, mode) in ratios]
        if got:
            parts.append(f"{mode} {part} " + ", ".join(got))
    return "; ".join(parts) or "torch.compile not run here"


# -- figures -----------------------------------------------------------------------------------------
def _situ_figure(path: Path, ratios: dict[tuple[str, str, str], float]) -> None:
    labels = [f"{part}\n{pas}" for part in ("activation", "gated MLP") for pas in ("fwd", "fwd+bwd")]
    keys = [(part, pas) for part in ("activation", "gated MLP") for pas in ("fwd", "fwd+bwd")]
    with plots.figure(path, size=(7.0, 3.8)) as (fig, ax):
        width = 0.38
        for j, (mode, color) in enumerate((("eager", "tab:red"), ("compiled", "tab:blue"))):
            values = [ratios.get((part, pas, mode), float("nan")) for part, pas in keys]
            xs = [i + (j - 0.5) * width for i in range(len(keys))]
            ax.bar(xs, values, width, label=mode if mode == "eager" else "torch.compile (fused)", color=color)
        ax.axhline(SITU_SLOWDOWN, ls="--", color="gray", label=f"article: ~{SITU_SLOWDOWN:g}x unfused")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(range(len(keys)), labels)
        ax.set_ylabel("SiTU time / SwiGLU time")
        ax.legend(fontsize=8)


def _moe_figure(path: Path, lat: dict[str, int], full: dict[str, int], times: dict[str, float],
                flop_ratio: float) -> None:
    with plots.figure(path, ncols=2, size=(10.0, 3.8)) as (fig, axes):
        ax = axes[0]
        bottoms = [0.0, 0.0]
        for name in lat:
            values = [lat[name] / 1e9, full[name] / 1e9]
            ax.bar(["latent (K3)", "full width"], values, bottom=bottoms, label=name)
            bottoms = [b + v for b, v in zip(bottoms, values)]
        ax.set_ylabel("GFLOPs per token, one MoE layer")
        ax.set_title("K3 size, on paper")
        ax.legend(fontsize=8)
        ax = axes[1]
        ax.bar(["latent", "full width"], [1e3 * times["latent"], 1e3 * times["full width"]], color="tab:green")
        ax.plot([0], [1e3 * times["full width"] * flop_ratio], "_", color="black", ms=60, mew=2,
                label="full width x FLOP ratio")
        ax.set_ylabel("forward ms")
        ax.legend(fontsize=8)
        ax.set_title("small size, measured")


def _attn_res_figure(path: Path, measured: list, k3: ModelConfig) -> None:
    with plots.figure(path, ncols=2, size=(10.0, 3.8)) as (fig, axes):
        ax = axes[0]
        width = 0.8 / len(PHASES)
        for j, phase in enumerate(PHASES):
            xs = [i + (j - (len(PHASES) - 1) / 2) * width for i in range(len(measured))]
            ax.bar(xs, [100 * over[phase] for _, _, over in measured], width, label=phase)
        ax.axhline(100 * ATTN_RES_LATENCY, ls="--", color="gray", label=f"article: +{100 * ATTN_RES_LATENCY:g}%")
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xticks(range(len(measured)), [f"d {cfg.hidden_size}" for cfg, _, _ in measured])
        ax.set_ylabel("latency overhead of AttnRes, %")
        ax.set_title("kimi-k3-tiny, measured")
        ax.legend(fontsize=8)
        ax = axes[1]
        counts = attn_res_source_counts(k3)
        ax.plot(range(len(counts)), counts, drawstyle="steps-post")
        ax.set_xlabel("AttnRes mix (2 per layer, then the final norm)")
        ax.set_ylabel("sources read")
        ax.set_title(f"K3: {k3.num_layers} layers, block {k3.attn_res_block_size}")
