"""Tiny models of each mixer trained on the synthetic recall tasks (`k3.lab.tasks`), with equal width, depth,
steps and seeds, so that the mixer is the only difference."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..bench.timing import threads
from ..models import CausalLM, ModelConfig
from .tasks import IGNORE, Batch

# the lineage, as the article walks it; "kda+mla" is Kimi Linear's 3:1 hybrid
MIXERS = ("softmax", "linear_attn", "deltanet", "gated_deltanet", "kda", "kda+mla")
LABELS = {"softmax": "softmax attention", "linear_attn": "linear attention", "deltanet": "DeltaNet",
          "gated_deltanet": "Gated DeltaNet", "kda": "KDA", "kda+mla": "KDA+MLA 3:1"}


@dataclass(frozen=True)
class Size:
    """Width, depth and the linear mixers' head size: a head's state is head_dim x head_dim."""

    width: int = 64
    layers: int = 4
    head_dim: int = 16
    max_len: int = 256  # softmax attention's learned positions
    chunk_size: int = 16  # short sequences: small chunks keep KDA's C x C x K intra-chunk work small

    @property
    def heads(self) -> int:
        return self.width // self.head_dim


def mixer_config(mixer: str, vocab_size: int, size: Size) -> ModelConfig:
    """A model whose every layer uses `mixer` ("kda+mla": KDA with every 4th layer MLA), RMSNorm, a SwiGLU MLP of
    twice the width. Softmax attention gets learned positions (the linear mixers' short convolution and the
    recurrence itself carry order); MLA is NoPE as in Kimi Linear."""
    if mixer not in MIXERS:
        raise ValueError(f"mixer must be one of {MIXERS}, got {mixer!r}")
    if size.width % size.head_dim:
        raise ValueError(f"Size.width ({size.width}) must be a multiple of head_dim ({size.head_dim})")
    common = dict(name=f"lab-{mixer}", vocab_size=vocab_size, hidden_size=size.width, num_layers=size.layers,
                  mlp_types=["dense"] * size.layers, intermediate_size=2 * size.width, ffn_activation="swiglu",
                  num_heads=size.heads, linear_num_heads=size.heads, linear_head_dim=size.head_dim,
                  chunk_size=size.chunk_size)
    if mixer == "softmax":
        return ModelConfig(layer_types=["mha"] * size.layers, max_position_embeddings=size.max_len, **common)
    gate = {"linear_attn": None, "deltanet": None, "gated_deltanet": "full"}.get(mixer, "low_rank")
    if mixer == "kda+mla":
        types = ["mla" if (i + 1) % 4 == 0 else "kda" for i in range(size.layers)]
        return ModelConfig(layer_types=types, linear_output_gate=gate, kv_lora_rank=size.width // 2,
                           qk_nope_head_dim=size.head_dim, qk_rope_head_dim=0, v_head_dim=size.head_dim, **common)
    return ModelConfig(layer_types=[mixer] * size.layers, linear_output_gate=gate, **common)


def masked_loss(model: CausalLM, batch: Batch) -> torch.Tensor:
    logits = model(batch.inputs)
    return F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE)


def train_on_task(config: ModelConfig, sample: Callable[[torch.Generator], Batch], steps: int, lr: float = 3e-3,
                  seed: int = 0, warmup: int = 50, progress=None) -> tuple[CausalLM, list[float]]:
    """AdamW with linear warm-up then cosine decay; `sample(generator)` gives each step's batch (fresh data every
    step, as in Zoology). Returns the model (in eval mode) and the loss per step."""
    torch.manual_seed(seed)
    model = CausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.1)
    data = torch.Generator().manual_seed(seed + 1)
    losses = []
    for step in range(steps):
        scale = min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in opt.param_groups:
            group["lr"] = lr * scale
        loss = masked_loss(model, sample(data))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if progress is not None:
            progress.update(1)
    return model.eval(), losses


@torch.no_grad()
def accuracy_by_kind(model: CausalLM, batch: Batch) -> dict[int, float]:
    """Fraction of queries answered exactly (argmax), per query kind."""
    prediction = model(batch.inputs).argmax(-1)
    scored = batch.targets != IGNORE
    correct = (prediction == batch.targets) & scored
    return {int(k): float(correct[batch.kind == k].float().mean()) for k in batch.kind[scored].unique()}


def _call_one_thread(fn, args):
    """fn(*args) on one thread: tiny models run fastest on one thread, since at these sizes a second thread
    costs more in synchronisation than it saves (and under load, far more). The cores are used by training
    models side by side instead."""
    with threads(1):
        return fn(*args)


def run_jobs(fn: Callable, jobs: list[tuple], desc: str, workers: int | None = None, show: bool = True) -> list:
    """[fn(*job) for job in jobs], one single-threaded job per core in separate processes (spawned, so each
    starts clean); in-process when there is one worker or one job. `fn` must be a module-level function."""
    from concurrent.futures import ProcessPoolExecutor, as_completed
    import multiprocessing

    from tqdm.auto import tqdm

    workers = min(workers or os.cpu_count() or 1, len(jobs))
    with tqdm(total=len(jobs), desc=desc, unit="model", disable=not show) as bar:
        if workers <= 1:
            out = []
            for job in jobs:
                out.append(_call_one_thread(fn, job))
                bar.update(1)
            return out
        results: list = [None] * len(jobs)
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(_call_one_thread, fn, job): i for i, job in enumerate(jobs)}
            for future in as_completed(futures):
                results[futures[future]] = future.result()
                bar.update(1)
        return results
