"""`k3 lab parts`: what K3's own parts cost, beside the article's figures.

Three claims, each measured side by side in one run:

- SiTU-GLU vs SwiGLU: "without a fused kernel, the new activation is almost 3x slower". The activation
  alone and the whole gated MLP (`k3.layers.ffn.GatedMLP`), forward and forward + backward, for the
  article's formula op by op (`situ_reference`, eager: unfused), k3's fused `situ` (one autograd
  function) and the formula `torch.compile`d (Inductor fuses the elementwise chain into one loop).
- Latent MoE vs a full-width MoE with the same experts and top-k: "the experts operate in a compressed
  latent space, which ... nearly halves the FLOPs". FLOPs per token on paper at K3's size (`moe_flops`),
  and the forward time of both at a small size with K3's proportions.
- Block Attention Residuals on vs off: "AttnRes adds roughly 2% inference latency". One K3 block (four
  layers at K3's proportions, `attn_res.k3_block_config`) with and without AttnRes over widths d: prefill
  and per-token decode latency, the overhead's trend fitted against d and extrapolated to K3's 7,168;
  on paper at K3's size, AttnRes' parameters and FLOPs per token (`attn_res_flops`).

Timings run torch on one thread and read that thread's CPU time (`time.thread_time`: on a quiet machine
the wall time, on a busy one without the time the thread spent waiting for a core); they interleave the
candidates round after round and keep each one's best round. The figures that matter are the ratios.

The package: one module per claim, each with its FLOP model, its timing and its verdict (`situ`,
`latent_moe`, `attn_res`), the closures they time (`cases`), and `report` and `report_attn_res`
(claims, tables, notes, figures); here `run`. Timing is `k3.bench.timing.interleaved_best` with a warm-up
call of every case ahead of the first round, gradients left on (the forward cases turn them off
themselves) and `thread_clock`.
"""

from __future__ import annotations

from pathlib import Path

from ...bench.timing import threads
from ...models import get_config
from ..report import Result, command
from ..text import paragraph
from . import report, report_attn_res
from .attn_res import k3_block_config, time_attn_res
from .latent_moe import time_moe
from .situ import time_activations, time_elementwise

TIMING_THREADS = 1

SIZES = {  # per mode: SiTU MLP (tokens, width, hidden), MoE at K3's proportions, rounds; the K3 block's
    # widths for AttnRes (the widest fills about 3.5 GB in quick mode, 8 GB in full mode), its prefill and
    # decode lengths and rounds (the block's widest widths take most of the minutes)
    "smoke": dict(
        ffn=(64, 32, 96),
        moe=dict(tokens=64, dim=64, latent=32, hidden=32, experts=8, top_k=4),
        rounds=1,
        attn_res_widths=(16, 24, 32, 40),
        prefill=16,
        decode_prompt=4,
        decode_steps=2,
        attn_res_rounds=1,
    ),
    "quick": dict(
        ffn=(2048, 256, 768),
        moe=dict(tokens=512, dim=512, latent=256, hidden=224, experts=64, top_k=16),
        rounds=7,
        attn_res_widths=(256, 512, 1024, 2048),
        prefill=128,
        decode_prompt=16,
        decode_steps=8,
        attn_res_rounds=6,
    ),
    "full": dict(
        ffn=(4096, 512, 1536),
        moe=dict(tokens=1024, dim=512, latent=256, hidden=224, experts=64, top_k=16),
        rounds=15,
        attn_res_widths=(256, 512, 1024, 1536, 2048, 3072),
        prefill=256,
        decode_prompt=64,
        decode_steps=16,
        attn_res_rounds=5,
    ),
}


def run(mode: str, docs: Path, **options) -> Result:
    """Time SiTU against SwiGLU, the latent against a full-width MoE, AttnRes on against off (see the
    module docstring), on one thread: the figures are ratios, a one-thread pool cannot stall waiting for
    a core that a busy machine gave away (two threads on a shared 2-core machine made tiny ops 100x
    slower in our runs), and one thread's CPU time leaves out the waits."""
    if options:
        raise ValueError(f"k3 lab parts takes no options, got {sorted(options)}")
    if mode not in SIZES:
        raise ValueError(f"k3 lab parts: `mode` must be one of {tuple(SIZES)}, got {mode!r}")
    with threads(TIMING_THREADS):
        return _run(mode, Path(docs))


def _run(mode: str, docs: Path) -> Result:
    s = SIZES[mode]
    rounds = s["rounds"]
    # measured first, in this order, on one thread
    compiled = mode != "smoke"
    compile_notes: list[str] = []
    compile_seconds: dict[str, float] = {}
    tokens, dim, hidden = s["ffn"]
    situ_times = time_activations(tokens, dim, hidden, rounds, compiled, compile_notes, compile_seconds)
    elementwise = time_elementwise(tokens, hidden, rounds, compiled)
    m = s["moe"]
    moe_times = time_moe(m["tokens"], m["dim"], m["latent"], m["hidden"], m["experts"], m["top_k"], rounds)
    widths = s["attn_res_widths"]
    attn_res_times = []  # (config, times) per width
    for width in widths:
        cfg = k3_block_config(width)
        times = time_attn_res(cfg, s["prefill"], s["decode_prompt"], s["decode_steps"], s["attn_res_rounds"])
        attn_res_times.append((cfg, times))
    if compiled:
        from torch import _dynamo

        _dynamo.reset()  # free the compiled graphs

    k3 = get_config("kimi-k3")
    situ = report.situ_part(docs, situ_times, elementwise, compiled, compile_notes, compile_seconds, s["ffn"], rounds)
    moe = report.moe_part(docs, k3, moe_times, m, rounds)
    attn_res = report_attn_res.attn_res_part(docs, k3, attn_res_times, s, s["attn_res_rounds"])
    sections = (situ, moe, attn_res)
    claims = [c for section in sections for c in section[0]]
    tables = [t for section in sections for t in section[1]]
    figures = situ[2] + attn_res[2] + moe[2]  # the order docs/results.md has shown them in
    notes = [paragraph("parts", "clock")] + [n for section in sections for n in section[3]]
    setup = dict(
        seed=0,
        threads=TIMING_THREADS,
        clock="time.thread_time",
        rounds=rounds,
        dtype="float32",
        situ=dict(tokens=tokens, dim=dim, hidden=hidden, beta=4.0, linear_beta=25.0, compiled=compiled),
        moe_small=m,
        attn_res=dict(
            model="one K3 block (k3.lab.parts.attn_res.k3_block_config)",
            widths=widths,
            prefill=s["prefill"],
            decode_prompt=s["decode_prompt"],
            decode_steps=s["decode_steps"],
            rounds=s["attn_res_rounds"],
        ),
    )
    return Result(
        name="parts",
        title="K3's parts: SiTU, the latent MoE and AttnRes",
        mode=mode,
        command=command("parts", mode),
        claims=claims,
        tables=tables,
        figures=figures,
        notes=notes,
        setup=setup,
        data=dict(
            attn_res={
                str(cfg.hidden_size): {f"{variant} {phase} seconds": t for (variant, phase), t in times.items()}
                for cfg, times in attn_res_times
            }
        ),
    )
