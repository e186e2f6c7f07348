"""Block Attention Residuals on against off: "AttnRes adds roughly 2% inference latency", as the claim means
it: at K3's width. One K3 block (four decoder layers, KDA, KDA, KDA, MLA, at K3's proportions of width
`d`: `k3_block_config`) with and without AttnRes, prefill and per-token decode latency over widths d
(`time_attn_res`); the overhead's trend fitted against d (`fit_overhead`) and carried to K3's 7,168
(an extrapolation: the widths measured stop where this machine's memory and minutes do); on paper at
K3's size, AttnRes' FLOPs per token (`attn_res_flops`).

The fit is physical, not a curve through the points: the block's time without AttnRes is a + b d + c d^2
(fixed per-op costs, work proportional to d: norms, elementwise ops, KDA state at K3's head size; and to
d^2: every matmul), what AttnRes adds is p + q d (a few ops per mix, each reading sources of width d),
so the overhead (p + q d) / (a + b d + c d^2) falls like 1/d once the matmuls dominate."""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations

import numpy as np
import torch

from ...bench.timing import interleaved_best, thread_clock
from ...models import CausalLM, ModelConfig, get_config
from ...models.decoder import attn_res_source_counts
from .cases import forward

ATTN_RES_LATENCY = 0.02  # the article (seed 003): "AttnRes adds roughly 2% inference latency"
PHASES = ("prefill", "decode")
K3_WIDTH = 7168
# the verdict: the fitted overhead at K3's width, in every phase
HOLDS_AT_MOST, PARTLY_AT_MOST = 0.04, 0.10
BLOCK_LAYERS = 4  # one K3 block: KDA, KDA, KDA, MLA
BLOCK_EXPERTS = 64  # routed experts in the block (K3: 896); top-k and the expert width stay K3's
BLOCK_VOCAB = 512  # the embedding and the head are not part of the block: a small vocabulary keeps them out
BLOCK_ATTN_RES = 1  # AttnRes block size in layers: the most sources four layers give (K3: 12 over 93 layers)


def attn_res_flops(config: ModelConfig) -> int:
    """AttnRes FLOPs per token: each mix over N sources of width d costs ~6 N d (the query dot product and
    the mean square per source, 2d each, then the weighted sum, 2d each); softmax over N is left out."""
    return sum(6 * n * config.hidden_size for n in attn_res_source_counts(config))


def mean_sources(config: ModelConfig) -> float:
    """The mean number of sources an AttnRes mix of `config` reads."""
    counts = attn_res_source_counts(config)
    if not counts:
        raise ValueError(f"mean_sources: {config.name!r} has no AttnRes (`attn_res_block_size` is None)")
    return sum(counts) / len(counts)


def k3_block_config(width: int, num_experts: int = BLOCK_EXPERTS) -> ModelConfig:
    """One K3 block at width `width`: kimi-k3's four layers KDA, KDA, KDA, MLA, all with the MoE FFN, every
    width of kimi-k3 scaled by width / 7168 (LoRA ranks, expert width, latent size, rounded to a multiple
    of 8), the head count scaled too while the head dims stay K3's (128; MLA 128 + 64 rope), so attention
    keeps K3's width per d; top-16 of `num_experts` routed experts, 2 shared; AttnRes over blocks of
    BLOCK_ATTN_RES layer; a BLOCK_VOCAB-token vocabulary."""
    if not isinstance(width, int) or width < 8:
        raise ValueError(f"k3_block_config: `width` must be an int >= 8, got {width!r}")
    k3 = get_config("kimi-k3")
    if num_experts < k3.num_experts_per_tok:
        raise ValueError(f"k3_block_config: `num_experts` must be >= top-k {k3.num_experts_per_tok}, got {num_experts}")
    f = width / k3.hidden_size

    def scaled(size: int) -> int:
        return max(8, 8 * round(size * f / 8))

    heads = max(1, round(k3.num_heads * f))
    return get_config(
        "kimi-k3",
        num_layers=BLOCK_LAYERS,
        hidden_size=width,
        vocab_size=BLOCK_VOCAB,
        num_heads=heads,
        linear_num_heads=heads,
        q_lora_rank=scaled(k3.q_lora_rank),
        kv_lora_rank=scaled(k3.kv_lora_rank),
        intermediate_size=scaled(k3.intermediate_size),
        moe_intermediate_size=scaled(k3.moe_intermediate_size),
        moe_latent_size=scaled(k3.moe_latent_size),
        num_experts=num_experts,
        attn_res_block_size=BLOCK_ATTN_RES,
    ).replace(name=f"kimi-k3-block-{width}", mlp_types=["moe"] * BLOCK_LAYERS)


def attn_res_pair(config: ModelConfig, seed: int = 0) -> dict[str, CausalLM]:
    """{"on": `config` with AttnRes, "off": without}, in eval mode; "off" holds the very tensors of "on"
    (every weight but the AttnRes queries, shared, not copied: the widest blocks fill memory once)."""
    if config.attn_res_block_size is None:
        raise ValueError(f"attn_res_pair: `config` must use AttnRes, got attn_res_block_size=None ({config.name!r})")
    torch.manual_seed(seed)
    on = CausalLM(config).eval()
    with torch.device("meta"):
        off = CausalLM(config.replace(attn_res_block_size=None))
    missing = off.load_state_dict(on.state_dict(), strict=False, assign=True).missing_keys
    if missing:
        raise RuntimeError(f"attn_res_pair: the model without AttnRes has weights the one with it lacks: {missing}")
    return {"on": on, "off": off.eval()}


def time_attn_res(
    config: ModelConfig, prefill: int, decode_prompt: int, decode_steps: int, rounds: int, seed: int = 0
) -> dict[tuple[str, str], float]:
    """{(variant, phase): seconds} for `config` with AttnRes ("on") and without ("off", `attn_res_pair`):
    "prefill" is one cached forward of `prefill` tokens, "decode" the mean time of one token over
    `decode_steps` steps after a `decode_prompt`-token prompt."""
    models = attn_res_pair(config, seed)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (1, max(prefill, decode_prompt + decode_steps)), generator=gen)

    def prefill_case(model):
        return forward(lambda: model(ids[:, :prefill], cache=model.new_cache(1), logits_to_keep=1))

    @torch.no_grad()
    def decode_step_seconds(model) -> float:
        cache = model.new_cache(1)
        model(ids[:, :decode_prompt], cache=cache, logits_to_keep=1)
        start = thread_clock()
        for t in range(decode_prompt, decode_prompt + decode_steps):
            model(ids[:, t : t + 1], cache=cache)
        return (thread_clock() - start) / decode_steps

    prefill_cases = {(name, "prefill"): prefill_case(m) for name, m in models.items()}
    best = interleaved_best(prefill_cases, rounds, warmup="ahead", grad=True, clock=thread_clock)
    for model in models.values():  # warm-up
        decode_step_seconds(model)
    for _ in range(rounds):  # the prompt is not timed, so these rounds interleave by hand
        for name, model in models.items():
            best[(name, "decode")] = min(best.get((name, "decode"), math.inf), decode_step_seconds(model))
    return best


@dataclass(frozen=True)
class OverheadFit:
    """Time without AttnRes a + b d + c d^2 (`off`: a, b, c), the time AttnRes adds p + q d (`extra`: p, q)."""

    off: tuple[float, float, float]
    extra: tuple[float, float]

    def off_seconds(self, width: float) -> float:
        a, b, c = self.off
        return a + b * width + c * width**2

    def extra_seconds(self, width: float) -> float:
        p, q = self.extra
        return p + q * width

    def overhead(self, width: float) -> float:
        """AttnRes' fitted latency overhead at `width`: extra / off."""
        return self.extra_seconds(width) / self.off_seconds(width)


def fit_overhead(widths: list[int], on: list[float], off: list[float]) -> OverheadFit:
    """Fit `OverheadFit` to the seconds measured with AttnRes (`on`) and without (`off`) at `widths`, in
    relative terms (every residual divided by that width's off time, so the small widths count as much
    as the large ones, and the extra's residuals are overheads): a, b, c >= 0 (the best of the fits on
    every subset of the three terms whose coefficients come out non-negative: non-negative least
    squares), p and q free. Needs three widths."""
    if not (len(widths) == len(on) == len(off)):
        raise ValueError(
            f"fit_overhead: `widths`, `on` and `off` must have one entry each, got lengths "
            f"{len(widths)}, {len(on)}, {len(off)}"
        )
    if len(set(widths)) < 3 or min(off) <= 0:
        raise ValueError(
            f"fit_overhead: needs three distinct widths and positive off times, got widths {widths}, off {off}"
        )
    d, t_on, t_off = (np.asarray(v, dtype=np.float64) for v in (widths, on, off))
    terms = np.stack([np.ones_like(d), d, d**2], axis=1) / t_off[:, None]
    best, best_residual = None, math.inf
    for n in (1, 2, 3):
        for kept in combinations(range(3), n):
            coef = np.linalg.lstsq(terms[:, kept], np.ones_like(d), rcond=None)[0]
            residual = float(np.sum((terms[:, kept] @ coef - 1) ** 2))
            if (coef >= 0).all() and residual < best_residual - 1e-15:
                best, best_residual = np.zeros(3), residual
                best[list(kept)] = coef
    extra = np.linalg.lstsq(
        np.stack([np.ones_like(d), d], axis=1) / t_off[:, None], (t_on - t_off) / t_off, rcond=None
    )[0]
    return OverheadFit(tuple(float(v) for v in best), tuple(float(v) for v in extra))


def leave_one_out(widths: list[int], on: list[float], off: list[float], width: float) -> tuple[float, float]:
    """The lowest and highest fitted overhead at `width` over the fits that leave one measured width out
    (needs four widths): how much the extrapolation rests on any single point."""
    if len(widths) < 4:
        raise ValueError(f"leave_one_out: needs four widths, got {len(widths)}")
    got = [
        fit_overhead(*(v[:i] + v[i + 1 :] for v in (list(widths), list(on), list(off)))).overhead(width)
        for i in range(len(widths))
    ]
    return min(got), max(got)


def attn_res_verdict(overheads: list[float]) -> str:
    """From the fitted overhead at K3's width in each phase: "roughly 2%" holds when every phase is within
    HOLDS_AT_MOST (4%), partly within PARTLY_AT_MOST (10%), else it does not hold."""
    worst = max(overheads)
    return "holds" if worst <= HOLDS_AT_MOST else "partly" if worst <= PARTLY_AT_MOST else "does not hold"
