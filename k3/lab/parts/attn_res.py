"""Block Attention Residuals on against off: "AttnRes adds roughly 2% inference latency". kimi-k3-tiny
with and without `attn_res_block_size`: prefill and per-token decode latency (`time_attn_res`); on paper
at K3's size, AttnRes' FLOPs per token (`attn_res_flops`)."""

from __future__ import annotations

import math

import torch

from ...bench.timing import interleaved_best, thread_clock
from ...models import CausalLM, ModelConfig
from ...models.model import attn_res_source_counts
from .cases import forward

ATTN_RES_LATENCY = 0.02  # the article (seed 003): "AttnRes adds roughly 2% inference latency"
PHASES = ("prefill", "decode")


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
        return forward(lambda: model(ids[:, :prefill], cache=model.new_cache(1)))

    @torch.no_grad()
    def decode_step_seconds(model) -> float:
        cache = model.new_cache(1)
        model(ids[:, :decode_prompt], cache=cache)
        start = thread_clock()
        for t in range(decode_prompt, decode_prompt + decode_steps):
            model(ids[:, t:t + 1], cache=cache)
        return (thread_clock() - start) / decode_steps

    prefill_cases = {(name, "prefill"): prefill_case(m) for name, m in models.items()}
    best = interleaved_best(prefill_cases, rounds, warmup="ahead", grad=True, clock=thread_clock)
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
