"""Tiny models of each mixer trained on the synthetic recall tasks (`k3.lab.tasks`), with equal width, depth,
steps, data and seeds, so that the mixer is the only difference; each trained at several learning rates (a sweep,
as Zoology does), keeping the best.

The recipe (how it was chosen: docs/lab.md): two layers (Zoology's depth), AdamW with a warm-up, a constant rate
and a linear decay over the last fifth of the steps (warmup-stable-decay), and one attention head as wide as the
model for the attention mixers (softmax attention, MLA); the linear mixers keep many small heads, since their
head size is their state size. Softmax attention reads q, k and v through the same short causal convolution the
linear family has (`ConvAttention`), and linear attention is DeltaNet's layer with the additive update
(`AdditiveLinearAttention`), so that what differs between the mixers is the memory, not the token shift or the
features: without the convolution, softmax attention must first form a previous-token head, then an induction
head, from learned positions before it can bind a key to the value after it.

The training is k3's (`k3.training`): its optimizer construction, its step (`training_step`: clipped gradients,
a non-finite loss caught before the weights change) and its warm-up and WSD schedule (`learning_rate`), with
the lab's settings as a TrainConfig (`recipe`). What the lab adds is the least training does not do: the loss
of a task is the cross-entropy at its scored positions only, L = mean over {t : y_t != IGNORE} of
-log p(y_t | x_{<=t}) (the batch goes to the step as inputs and targets, not as next-token windows), and
`train_until_plateau` starts its decay at a step the held-out score chooses, lr_t = lr (s + D - t) / D for
t in [s, s + D), where training's schedule fixes the decay's start from the run's length."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..models import CausalLM, ModelConfig
from ..training import TrainConfig, build_optimizer, learning_rate, training_step
from ..training.step import NonFiniteLossError
from .mixers import AdditiveLinearAttention, ConvAttention, ConvLatentAttention
from .tasks import IGNORE, Batch

# the lineage, as the article walks it; "kda+mla" is Kimi Linear's hybrid (`hybrid_layers`: 3:1 from 4 layers)
MIXERS = ("softmax", "linear_attn", "deltanet", "gated_deltanet", "kda", "kda+mla")
# Kimi's own cycle, 3 KDA : 1 MLA (4 layers), and KDA alone at that depth to set it beside
DEEP_MIXERS = ("4kda", "3kda+mla")
# probes of why a hybrid's MLA layer may not retrieve: MLA alone, softmax attention in MLA's place, MLA first,
# and the 3:1 cycle with its KDA layers' output projections zero at the start (`ZERO_LINEAR_OUTPUTS`); and linear
# attention as the article writes it (k3.layers.LinearAttention: ELU+1 features, a normaliser, no convolution)
PROBE_MIXERS = ("2mla", "3kda+mha", "mla+3kda", "3kda0+mla", "frozen3kda+mla", "elu_linear_attn")
# the layers of the mixers that are not one kind repeated (the hybrid "kda+mla" takes `hybrid_layers`)
LAYOUT = {
    "3kda+mla": ["kda", "kda", "kda", "mla"],
    "2mla": ["mla", "mla"],
    "3kda+mha": ["kda", "kda", "kda", "mha"],
    "mla+3kda": ["mla", "kda", "kda", "kda"],
    "3kda0+mla": ["kda", "kda", "kda", "mla"],
    "frozen3kda+mla": ["kda", "kda", "kda", "mla"],
}
# models whose linear layers start with o_proj = 0: at the start they add nothing to the residual stream, so the
# attention layer after them reads the token embeddings as the first layer does
ZERO_LINEAR_OUTPUTS = ("3kda0+mla",)
# models whose linear mixers never train (their initial weights throughout; the MLPs around them do): nothing
# but the attention layer can learn to carry a binding across the sequence
FROZEN_LINEAR = ("frozen3kda+mla",)
DEPTH = {"4kda": 4, **{m: len(layers) for m, layers in LAYOUT.items()}}  # their own depth (others: Size.layers)
LABELS = {
    "softmax": "softmax attention",
    "linear_attn": "linear attention",
    "deltanet": "DeltaNet",
    "gated_deltanet": "Gated DeltaNet",
    "kda": "KDA",
    "kda+mla": "KDA+MLA hybrid",
    "4kda": "KDA, 4 layers",
    "3kda+mla": "3 KDA : 1 MLA, 4 layers",
    "2mla": "MLA alone, 2 layers",
    "3kda+mha": "3 KDA : 1 softmax attention",
    "mla+3kda": "MLA first, then 3 KDA",
    "3kda0+mla": "3 KDA : 1 MLA, KDA outputs zero at the start",
    "frozen3kda+mla": "3 KDA, frozen at the start : 1 MLA",
    "elu_linear_attn": "linear attention, the article's (ELU+1, normalised)",
}


@dataclass(frozen=True)
class Size:
    """Width, depth and the linear mixers' head size: a head's state is head_dim x head_dim."""

    width: int = 64
    layers: int = 2
    head_dim: int = 16
    max_len: int = 256  # softmax attention's learned positions
    chunk_size: int = 16  # short sequences: small chunks keep KDA's C x C x K intra-chunk work small
    attention_heads: int = 1  # softmax attention and MLA: heads of width / attention_heads (Zoology: one head)

    @property
    def heads(self) -> int:
        return self.width // self.head_dim

    def state_per_head(self) -> str:
        """A linear head's state, as the tables print it: "8×8 (8 heads × 2 layers)"."""
        return f"{self.head_dim}×{self.head_dim} ({self.heads} heads × {self.layers} layers)"


def hybrid_layers(layers: int) -> list[str]:
    """Kimi Linear's 3:1 pattern, every 4th layer MLA; a model of fewer than 4 layers keeps one MLA layer, its
    last (two layers: KDA then MLA)."""
    types = ["mla" if (i + 1) % 4 == 0 else "kda" for i in range(layers)]
    if "mla" not in types:
        types[-1] = "mla"
    return types


def mixer_config(mixer: str, vocab_size: int, size: Size) -> ModelConfig:
    """A model whose every layer uses `mixer` ("kda+mla": `hybrid_layers`; the 4-layer `DEEP_MIXERS` and the
    `PROBE_MIXERS`: `LAYOUT`, "4kda" four KDA layers), RMSNorm, a SwiGLU MLP of twice the width. Softmax
    attention gets learned positions (the linear mixers' short convolution and the recurrence
    itself carry order); MLA is NoPE as in Kimi Linear. Attention heads: `size.attention_heads`. KDA uses Kimi
    K3's safe gate g = -5 sigmoid(exp(A_log) (f + dt_bias)): most channels start with no forgetting at all, and no
    step forgets more than e^-5. Kimi Linear's unbounded g = -exp(A_log) softplus(f + dt_bias) learned recall far
    more slowly on these tasks (docs/lab.md)."""
    if mixer not in MIXERS + DEEP_MIXERS + PROBE_MIXERS:
        raise ValueError(f"mixer must be one of {MIXERS + DEEP_MIXERS + PROBE_MIXERS}, got {mixer!r}")
    layers = DEPTH.get(mixer, size.layers)
    for name in ("head_dim", "attention_heads"):
        if size.width % getattr(size, name):
            raise ValueError(f"Size.width ({size.width}) must be a multiple of {name} ({getattr(size, name)})")
    common = dict(
        name=f"lab-{mixer}",
        vocab_size=vocab_size,
        hidden_size=size.width,
        num_layers=layers,
        mlp_types=["dense"] * layers,
        intermediate_size=2 * size.width,
        ffn_activation="swiglu",
        num_heads=size.heads,
        linear_num_heads=size.heads,
        linear_head_dim=size.head_dim,
        chunk_size=size.chunk_size,
    )
    attention_head_dim = size.width // size.attention_heads
    if mixer == "softmax":
        return ModelConfig(
            layer_types=["mha"] * size.layers,
            max_position_embeddings=size.max_len,
            **{**common, "num_heads": size.attention_heads},
        )
    gate = {"linear_attn": None, "deltanet": None, "gated_deltanet": "full"}.get(mixer, "low_rank")
    common["kda_gate"] = "safe"  # KDA as Kimi K3 runs it (see the docstring)
    if mixer == "kda+mla" or mixer in LAYOUT:  # the attention layers: NoPE, one head as wide as the model
        return ModelConfig(
            layer_types=LAYOUT.get(mixer, hybrid_layers(layers)),
            linear_output_gate=gate,
            kv_lora_rank=size.width // 2,
            qk_nope_head_dim=attention_head_dim,
            qk_rope_head_dim=0,
            v_head_dim=attention_head_dim,
            **{**common, "num_heads": size.attention_heads},
        )
    kind = "linear_attn" if mixer == "elu_linear_attn" else mixer.removeprefix("4")
    return ModelConfig(layer_types=[kind] * layers, linear_output_gate=gate, **common)


def build_model(config: ModelConfig) -> CausalLM:
    """CausalLM(config), its softmax attention layers (if any) made `ConvAttention`, its MLA layers
    `ConvLatentAttention` and its linear attention layers `AdditiveLinearAttention` (same initial weights for
    what they share; "elu_linear_attn" keeps k3's `LinearAttention`); a `ZERO_LINEAR_OUTPUTS` model's linear
    layers with o_proj = 0, a `FROZEN_LINEAR` model's linear mixers without gradients."""
    model = CausalLM(config)
    for layer, kind in zip(model.model.layers, config.layer_types):
        if kind == "mha":
            conv = ConvAttention(config.hidden_size, config.num_heads, config.conv_size)
        elif kind == "mla":
            conv = ConvLatentAttention.like(layer.self_attn, config.conv_size)
        elif kind == "linear_attn" and config.name != "lab-elu_linear_attn":
            conv = AdditiveLinearAttention(
                config.hidden_size,
                config.linear_num_heads,
                config.linear_head_dim,
                output_gate=None,
                conv_size=config.conv_size,
                chunk_size=config.chunk_size,
            )
        else:
            continue
        conv.load_state_dict(layer.self_attn.state_dict(), strict=False)
        layer.self_attn = conv
    mixer = config.name.removeprefix("lab-")
    for layer, kind in zip(model.model.layers, config.layer_types):
        if kind in ("mha", "mla"):
            continue
        if mixer in ZERO_LINEAR_OUTPUTS:
            with torch.no_grad():
                layer.self_attn.o_proj.weight.zero_()
        if mixer in FROZEN_LINEAR:
            layer.self_attn.requires_grad_(False)
    return model


def masked_loss(model: CausalLM, batch: Batch) -> torch.Tensor:
    """Cross-entropy at the scored positions only (`CausalLM(targets=...)`: the LM head runs on those rows
    alone, which matters with a large vocabulary: a query is one position in four)."""
    return model(batch.inputs, targets=batch.targets)


def recipe(lr: float, warmup: int = 50) -> TrainConfig:
    """The lab's optimizer and schedule in training's terms: AdamW (betas 0.9, 0.98; weight decay 0.1 on the
    matrices only, as `k3 train`: not on norms, biases, KDA's and Gated DeltaNet's A_log and dt_bias), gradients
    clipped to norm 1, no QK-Clip, a linear warm-up over `warmup` steps, then WSD: constant, and linear to 0 over
    the last fifth of the steps (`k3.training.learning_rate`)."""
    return TrainConfig(
        optimizer="adamw",
        lr=lr,
        betas=(0.9, 0.98),
        weight_decay=0.1,
        grad_clip=1.0,
        qk_clip=0.0,
        warmup_steps=warmup,
        schedule="wsd",
        wsd_decay_fraction=0.2,
        min_lr_ratio=0.0,
    )


def train_on_task(
    config: ModelConfig,
    sample: Callable[[torch.Generator], Batch],
    steps: int,
    lr: float = 1e-3,
    seed: int = 0,
    warmup: int = 50,
    progress=None,
) -> tuple[CausalLM, list[float]]:
    """`steps` of training's step on `recipe(lr, warmup)`; `sample(generator)` gives each step's batch (fresh data
    every step, as in Zoology). The rate of step s is training's WSD rate for a run of steps + 1 steps, whose last
    step (at rate 0, a step that changes nothing) is not taken, so every step taken moves the weights. A run that
    meets a non-finite loss stops there. Returns the model (in eval mode) and the loss per step."""
    cfg = recipe(lr, warmup)
    model, opt, data = _start(config, cfg, seed)
    losses = []
    for step in range(steps):
        try:
            losses.append(_step(model, opt, sample(data), cfg, learning_rate(cfg, step, steps + 1)))
        except NonFiniteLossError:
            break
        if progress is not None:
            progress.update(1)
    return model.eval(), losses


def _start(config: ModelConfig, cfg: TrainConfig, seed: int):
    """The model (seeded), training's optimizer for it (`build_optimizer`, torch's default AdamW implementation:
    the fused one rounds differently, and the recorded results came from the default) and the data's generator."""
    torch.manual_seed(seed)
    model = build_model(config)
    return model, build_optimizer(model, cfg, fused=False), torch.Generator().manual_seed(seed + 1)


def _step(model: CausalLM, opt: torch.optim.Optimizer, batch: Batch, cfg: TrainConfig, lr: float) -> float:
    """Training's step (`k3.training.training_step`) at rate `lr` on a task's batch: the loss is the cross-entropy
    at the scored positions only (`batch.targets`, IGNORE elsewhere), not the next-token loss of every position,
    which is why the batch goes in as inputs and targets. Returns the loss."""
    for group in opt.param_groups:
        group["lr"] = lr
    return training_step(model, opt, batch.inputs, cfg, targets=batch.targets)


@dataclass(frozen=True)
class Plateau:
    """When a cell has converged, and the schedule that follows from it (warmup-stable-decay with the stable
    phase ended by the data rather than by a fixed step count).

    Every `every` steps the model is scored on a fixed held-out set; the stable phase (constant rate after a
    warm-up of `warmup` steps) ends once `patience` evaluations in a row have failed to beat the best so far
    by `min_gain` (not before `min_steps`, and not while the best is below `floor`: a run that has not left
    chance has not converged, it has not started), or at `max_steps`; then the rate falls linearly to 0 over
    `decay` times the steps taken so far, and the model after that decay is the cell's."""

    every: int = 100
    patience: int = 4
    min_gain: float = 0.01
    min_steps: int = 400
    max_steps: int = 4000
    decay: float = 0.2
    warmup: int = 50
    floor: float = 0.0

    def __post_init__(self):
        for name in ("every", "patience", "min_steps", "max_steps", "warmup"):
            if getattr(self, name) < 1:
                raise ValueError(f"Plateau.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"Plateau.decay must be in (0, 1], got {self.decay}")
        if not 0 <= self.floor < 1:
            raise ValueError(f"Plateau.floor must be in [0, 1), got {self.floor}")


@dataclass
class Curve:
    """A training run as `train_until_plateau` saw it: (step, held-out score) at every evaluation, the step
    where the stable phase ended (None if it never did) and why ("plateau", "budget", or "diverged": a
    non-finite loss stopped the run, the model as it was before that step), and the steps taken in all."""

    points: list[tuple[int, float]]
    stable_steps: int | None
    stopped_by: str
    steps: int


def train_until_plateau(
    config: ModelConfig,
    sample: Callable[[torch.Generator], Batch],
    score: Callable[[CausalLM], float],
    plateau: Plateau = Plateau(),
    lr: float = 1e-3,
    seed: int = 0,
) -> tuple[CausalLM, Curve]:
    """`train_on_task`'s model, optimizer and data, trained until `score(model)` (a held-out accuracy, higher
    is better) stops improving, by `plateau`'s rule: a constant rate after the warm-up until the plateau or
    the step budget, then a linear decay to 0 over a fifth (`plateau.decay`) of the steps so far. Returns the
    model (in eval mode) and its `Curve`."""
    cfg = recipe(lr, plateau.warmup)
    model, opt, data = _start(config, cfg, seed)
    points: list[tuple[int, float]] = []
    best, stale = -1.0, 0
    stable, stopped_by, decay_steps = None, "budget", 0
    step = 0

    def evaluate():
        model.eval()
        points.append((step, float(score(model))))
        model.train()
        return points[-1][1]

    while stable is None or step < stable + decay_steps:
        if stable is None:  # training's warm-up, then its constant rate (the run's length is not known yet)
            rate = learning_rate(cfg, step, None)
        else:  # the decay starts where the data said: training's schedule fixes it from the run's length
            rate = lr * ((stable + decay_steps - step) / decay_steps)
        try:
            _step(model, opt, sample(data), cfg, rate)
        except NonFiniteLossError:
            stopped_by = "diverged"
            break
        step += 1
        if step % plateau.every == 0 or (stable is not None and step == stable + decay_steps):
            value = evaluate()
            if stable is None:
                if value >= best + plateau.min_gain:
                    best, stale = value, 0
                else:
                    stale += 1
                if step >= plateau.min_steps and stale >= plateau.patience and best >= plateau.floor:
                    stopped_by = "plateau"
                if stopped_by == "plateau" or step >= plateau.max_steps:
                    stable, decay_steps = step, max(1, round(plateau.decay * step))
    if not points or points[-1][0] != step:
        evaluate()
    return model.eval(), Curve(points, stable, stopped_by, step)


@torch.no_grad()
def accuracy_by_kind(model: CausalLM, batch: Batch) -> dict[int, float]:
    """Fraction of queries answered exactly (argmax), per query kind."""
    scored = batch.targets != IGNORE
    prediction = model.lm_head(model.model(batch.inputs, None)[scored]).argmax(-1)  # the scored rows only
    correct = prediction == batch.targets[scored]
    kinds = batch.kind[scored]
    return {int(k): float(correct[kinds == k].float().mean()) for k in kinds.unique()}


def best_over_rates(by_rate: dict[float, dict]) -> tuple[dict, dict]:
    """Zoology's reading of a learning-rate sweep: for every cell (a key of the per-rate dicts) the best
    accuracy over the rates, and the rate that gave it. `by_rate` {lr: {cell: accuracy}}."""
    cells = next(iter(by_rate.values())).keys()
    best_rate = {c: max(by_rate, key=lambda lr: _ordered(by_rate[lr][c])) for c in cells}
    return {c: by_rate[best_rate[c]][c] for c in cells}, best_rate


def mean_per_rate(by_rate: dict[float, dict]) -> dict[float, float]:
    """The sweep table's reading: each rate's mean accuracy over its cells. `by_rate` {lr: {cell: accuracy}}."""
    return {lr: sum(cells.values()) / len(cells) for lr, cells in by_rate.items()}


def rate_label(lr: float) -> str:
    """A learning rate as the tables print it: 0.0005 -> "5e-4"."""
    return f"{lr:.0e}".replace("e-0", "e-")


def _ordered(accuracy: float) -> float:
    return -1.0 if accuracy != accuracy else accuracy  # a NaN cell (no such query) never wins
