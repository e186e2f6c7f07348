"""Training and scoring one recall cell (`score_mixer`), and the measures read off a trained model: the attention
layers' share on the bound value (`mla_retrieval`), the filler probe and the residual stream at the start."""

from __future__ import annotations

import time

import torch

from ...bench.profile import captured_inputs
from ...layers.mla import MultiHeadLatentAttention
from ..synthetic import ConvAttention, accuracy_by_kind, build_model, mixer_config, train_until_plateau
from ..tasks import IGNORE, mqar
from .plan import Plan


def score_mixer(plan: Plan, mixer: str, head_dim: int, lr: float, train_from: int = 1) -> dict:
    """Train one `mixer` model at state size `head_dim` and rate `lr` on pair counts drawn uniformly from
    `plan.trained` (from `train_from` pairs up; a fresh batch of one count each step) until `plan.plateau` ends it,
    scored on a held-out set per count every `plateau.every` steps; then score it on sequences of another seed. Returns
    {"accuracy": {pairs: accuracy}, "curve": [(step, held-out mean accuracy)], "stable": steps before the
    decay, "stopped_by": "plateau" | "budget", "steps"}; a model with MLA layers adds "retrieval" {pairs:
    `mla_retrieval`} at every count, linear attention and DeltaNet "filler" (`filler_probe`)."""
    vocab, size, pairs = plan.vocab, plan.size(head_dim), plan.pairs(head_dim)
    trained = [p for p in plan.trained(head_dim) if p >= train_from] or [max(plan.trained(head_dim))]

    def sample(g: torch.Generator):
        p = trained[int(torch.randint(len(trained), (1,), generator=g))]
        return mqar(plan.batch, 4 * p, p, vocab, generator=g)

    held_gen = torch.Generator().manual_seed(5_000 + plan.seed)
    held = [mqar(plan.held_batch, 4 * p, p, vocab, generator=held_gen) for p in pairs]

    def held_out(model) -> float:
        return sum(accuracy_by_kind(model, b).get(1, 0.0) for b in held) / len(held)

    start = time.perf_counter()
    model, curve = train_until_plateau(
        mixer_config(mixer, vocab.size, size), sample, held_out, plan.plateau, lr=lr, seed=plan.seed
    )
    test = torch.Generator().manual_seed(10_000 + plan.seed)
    out = {
        "accuracy": {
            p: accuracy_by_kind(model, mqar(plan.eval_batch, 4 * p, p, vocab, generator=test)).get(1, 0.0)
            for p in pairs
        },
        "curve": curve.points,
        "stable": curve.stable_steps,
        "stopped_by": curve.stopped_by,
        "steps": curve.steps,
    }
    probe = torch.Generator().manual_seed(20_000 + plan.seed)
    if mixer != "softmax" and {"mla", "mha"} & set(model.config.layer_types):  # MLA, or attention in a hybrid
        out["retrieval"] = {
            p: mla_retrieval(model, mqar(plan.probe_batch, 4 * p, p, vocab, generator=probe)) for p in pairs
        }
    if mixer in ("linear_attn", "deltanet"):
        out["filler"] = filler_probe(model, plan, head_dim, probe)
    out["seconds"] = time.perf_counter() - start  # on one thread
    return out


def filler_probe(model, plan: Plan, head_dim: int, generator: torch.Generator) -> dict[str, float]:
    """Filler, on a model trained without it: D pairs scored at T = 4 x D (no filler) and at T = 4 x the most
    pairs (PAD tokens between the bindings and the queries). Linear attention writes k^T v for every token,
    PAD included, and nothing takes it out again; the delta rule's write strength beta can leave a PAD token
    unwritten."""
    vocab, p = plan.vocab, head_dim
    long = 4 * plan.span * head_dim
    return {
        "pairs": p,
        "long": long,
        "no filler": accuracy_by_kind(model, mqar(plan.probe_batch, 4 * p, p, vocab, generator=generator))[1],
        "filler": accuracy_by_kind(model, mqar(plan.probe_batch, long, p, vocab, generator=generator))[1],
    }


@torch.no_grad()
def mla_retrieval(model, batch) -> dict[str, float | list[list[float]]]:
    """How the attention layers of a model (MLA, and the lab's softmax `ConvAttention` where a probe puts one in a
    hybrid) read an MQAR batch: for every such layer and head, the mean attention from a query key to the
    positions that hold the value bound to that key (the token after the key's binding, the one to copy; with
    the lab's short convolutions the W positions from it on, which the convolution carries it into), and what
    uniform attention over the visible tokens would put there: `{"value": [layer][head], "key": [layer][head],
    "uniform": float}`, "key" the attention on the key's binding itself."""
    layers = [m for m in model.modules() if isinstance(m, (MultiHeadLatentAttention, ConvAttention))]
    inputs = _inputs_of(model, layers, batch.inputs)
    rows, cols = (batch.targets != IGNORE).nonzero(as_tuple=True)  # every query
    queried = batch.inputs[rows, cols]
    # a query's binding: the first position holding the same key (the bindings come first)
    binding = (batch.inputs[rows] == queried[:, None]).int().argmax(1)
    windows = [getattr(layer, "window", 1) for layer in layers]
    value, key = [], []
    for i, (layer, window) in enumerate(zip(layers, windows)):
        probs = layer.attention_probs(inputs[i])  # [B, H, T, T]
        holds = binding[:, None] + torch.arange(1, window + 1)  # [Q, W]
        visible = (holds <= cols[:, None]).unsqueeze(-1)  # the causal mask's zeros, never read past T
        on_value = probs[rows[:, None], :, cols[:, None], holds.clamp(max=cols[:, None])] * visible  # [Q, W, H]
        value.append(on_value.sum(1).mean(0).tolist())
        key.append(probs[rows, :, cols, binding].mean(0).tolist())
    window = max(windows, default=1)
    uniform = (window / (cols.double() + 1)).clamp(max=1).mean().item()
    return {"value": value, "key": key, "uniform": uniform}


@torch.no_grad()
def stream_ratio(mixer: str, plan: Plan, head_dim: int) -> float:
    """At initialisation, how much the layers before a model's first attention layer add to the residual stream
    it reads, against the token embeddings: ||x - embedding|| / ||embedding|| at that layer's input, on one
    MQAR batch at the most pairs."""
    torch.manual_seed(plan.seed)
    model = build_model(mixer_config(mixer, plan.vocab.size, plan.size(head_dim))).eval()
    index = next(i for i, kind in enumerate(model.config.layer_types) if kind in ("mla", "mha"))
    batch = mqar(
        plan.probe_batch,
        4 * max(plan.pairs(head_dim)),
        max(plan.pairs(head_dim)),
        plan.vocab,
        generator=torch.Generator().manual_seed(30_000 + plan.seed),
    )
    (x,) = _inputs_of(model, [model.model.layers[index]], batch.inputs)
    embedding = model.model.embed_tokens(batch.inputs)
    return float((x - embedding).norm() / embedding.norm())


def _inputs_of(model, modules: list, ids: torch.Tensor) -> list[torch.Tensor]:
    """What each of `modules` receives as its first input when `model` runs on `ids` (the first call of each)."""
    captured = captured_inputs(model, dict(enumerate(modules)), ids)
    return [captured[i][0][0] for i in range(len(modules))]


def best_head(retrieval: dict) -> float:
    """The largest mean attention any attention head puts on the bound value (`mla_retrieval`)."""
    return max(a for heads in retrieval["value"] for a in heads)
