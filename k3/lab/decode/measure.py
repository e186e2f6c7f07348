"""What `k3 lab decode` measures: the four models, caches that hold N tokens (filled, or really
prefilled for the check; the package docstring says why filling is faithful), their bytes against the
config's count, and decode steps timed round-robin."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from ...models import CausalLM, get_config
from ...models.kinds import MIXERS
from ...models.model import Cache

WIDTH = 128  # hidden_size of every model: gpt2-tiny's and kimi-linear-tiny's own; kimi-k3-tiny narrowed from 192
BASELINE = "gpt2-tiny"
ALL_KDA = "all-KDA"
MODELS = (BASELINE, "kimi-linear-tiny", "kimi-k3-tiny", ALL_KDA)
CLAIMED_CONTEXT = 1 << 20  # the Kimi Linear report's 6x is at 1M tokens
PROMPT = 8  # tokens of the real prefill that gives every layer its cache before filling


@dataclass(frozen=True)
class Sweep:
    lengths: tuple[int, ...]  # context lengths N
    warmup: int  # untimed decode steps of every (model, N) pair first
    steps: int  # timed decode steps of every (model, N) pair (the median is kept)
    check_length: int  # N of the filled-versus-prefilled check


SWEEPS = {
    "smoke": Sweep((64, 128, 256), warmup=1, steps=3, check_length=64),
    "quick": Sweep((1024, 2048, 4096, 8192, 16384, 32768, 65536), warmup=3, steps=31, check_length=1024),
    "full": Sweep((1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072), warmup=5, steps=101, check_length=2048),
}


def build_models(max_length: int, seed: int = 0) -> dict[str, CausalLM]:
    """The four models at width WIDTH, seeded; gpt2-tiny gets learned positions for `max_length` tokens."""
    models = {}
    for name in MODELS:
        torch.manual_seed(seed)
        if name == BASELINE:
            config = get_config(name, hidden_size=WIDTH, max_position_embeddings=max_length)
        elif name == ALL_KDA:
            base = get_config("kimi-linear-tiny", hidden_size=WIDTH)
            config = base.replace(name="kimi-linear-tiny-all-kda", layer_types=["kda"] * base.num_layers)
        else:
            config = get_config(name, hidden_size=WIDTH)
        models[name] = CausalLM(config).eval()
    return models


def fill_cache(model: CausalLM, length: int, generator: torch.Generator) -> Cache:
    """A cache that holds `length` tokens: a real prefill of PROMPT tokens, then every KV and latent
    cache replaced by random tensors of `length` tokens (the shapes a prefill of `length` leaves)."""
    if length < PROMPT:
        raise ValueError(f"fill_cache: `length` must be at least {PROMPT} (the real prefill), got {length}")
    cache = model.new_cache(1)
    prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT), generator=generator)
    with torch.inference_mode():
        model(prompt, cache=cache)

    cache.check_room(length - PROMPT)  # the slots a prefill of `length` tokens leaves
    for layer in cache.layers:
        for tensor, axis in layer.storage.values():  # the tensors that grow with the sequence; states do not
            held = tensor.narrow(axis, 0, length)
            held.copy_(torch.randn(held.shape, generator=generator, dtype=held.dtype))
    cache.positions.fill_(length)
    cache.lengths = [length]
    return cache


def prefill_cache(model: CausalLM, length: int, generator: torch.Generator) -> Cache:
    """A cache that holds `length` tokens, by really running them through the model."""
    cache = model.new_cache(1)
    with torch.inference_mode():
        model(torch.randint(0, model.config.vocab_size, (1, length), generator=generator), cache=cache)
    return cache


def time_steps(entries: dict, warmup: int, steps: int) -> dict:
    """Median seconds of one decode step (one token, batch 1) for each entry, key -> (model, cache).
    Steps go round-robin across the entries, so every entry sees the same phases of a noisy machine,
    in reverse order every other round, so that no entry always follows the same one (the step after
    another model's runs with colder caches than the step after its own)."""
    token = torch.ones(1, 1, dtype=torch.long)
    order = list(entries)
    times: dict = {key: [] for key in entries}
    with torch.inference_mode():
        for step in range(warmup + steps):
            for key in order if step % 2 == 0 else reversed(order):
                model, cache = entries[key]
                start = time.perf_counter()
                model(token, cache=cache)
                if step >= warmup:
                    times[key].append(time.perf_counter() - start)
    return {key: statistics.median(t) for key, t in times.items()}


def check_fill(models: dict[str, CausalLM], length: int, sweep: Sweep, seed: int = 0) -> dict[str, dict]:
    """At `length` tokens: cache bytes and median decode time from a filled cache and from a real
    prefill, per model. The layouts must agree exactly (else the method is wrong and this raises)."""
    gen = torch.Generator().manual_seed(seed)
    entries = {}
    for name, model in models.items():
        real, filled = prefill_cache(model, length, gen), fill_cache(model, length, gen)
        if real.nbytes(held=True) != filled.nbytes(held=True) or layout(real) != layout(filled):
            raise RuntimeError(
                f"check_fill: {name}: a filled cache of {length} tokens differs from a prefilled "
                f"one: {layout(filled)} against {layout(real)}"
            )
        entries[(name, "prefilled")], entries[(name, "filled")] = (model, real), (model, filled)
    times = time_steps(entries, sweep.warmup, sweep.steps)
    return {
        name: {
            "bytes": entries[(name, "filled")][1].nbytes(held=True),
            "prefilled": times[(name, "prefilled")],
            "filled": times[(name, "filled")],
        }
        for name in models
    }


def layout(cache: Cache) -> list[list[tuple]]:
    """(shape, dtype) of every tensor of every layer's cache."""
    return [[(tuple(t.shape), t.dtype) for t in layer.buffers()] for layer in cache.layers]


def expected_bytes(model: CausalLM, length: int) -> dict[str, int]:
    """Cache bytes per layer type from the config alone (`k3.models.kinds`, every value float32): MHA
    2·H·d per token, MLA (kv_lora_rank + qk_rope_head_dim) per token, KDA three conv states H·K·(W-1)
    and the state H·K·V, whatever the length."""
    c, size = model.config, 4
    out: dict[str, int] = {}
    for kind in c.layer_types:
        mixer = MIXERS[kind]
        out[kind] = out.get(kind, 0) + mixer.cache_bytes_per_token(c, size) * length + mixer.state_bytes(c, size)
    return out
