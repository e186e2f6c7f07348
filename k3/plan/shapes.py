"""Where every parameter of a model sits under k3's FSDP2 + expert-parallel layout, and how many of
its values one rank holds: the figures a training plan's memory starts from, exact to the value.

Layout (`Layout`): `gpus` = `pp` pipeline stages x `fsdp` ranks per stage. Inside a stage:

- every parameter but the routed experts is sharded by FSDP2 over the stage's `fsdp` ranks;
- the routed experts of each MoE layer are split over `ep` ranks as `k3 train --parallel ep` splits
  them (rank r keeps experts [e E/ep, (e+1) E/ep), e = r mod ep), and each kept expert is sharded
  by FSDP2 over the fsdp/ep ranks that hold the same experts (torchtitan's "dp_shard_mod_ep" mesh).

FSDP2 shards a parameter along its first dimension as `torch.chunk` does: ceil(n / M) rows to each of
the first ranks, the rest (possibly nothing) to the last. Shapes come from the model's own modules,
one decoder layer of each kind built on the meta device (no memory, a fraction of a second), so the
counts are the constructors', not a formula's.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..models import CausalLM, ModelConfig
from ..models.decoder import DecoderLayer

EXPERTS_PREFIX = "block_sparse_moe.experts."


@dataclass(frozen=True)
class Param:
    shape: tuple[int, ...]
    kind: str  # "matrix" (Muon's: 2-D, both sides > 1), "vector" (norms, biases, queries...) or "embedding"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class ModelShapes:
    """Every parameter's shape, grouped as the layout needs them."""

    first: list[Param]  # embeddings: the first pipeline stage's root parameters
    last: list[Param]  # final norm, final AttnRes mix, lm_head: the last stage's
    layers: list[list[Param]]  # each decoder layer's, routed experts left out
    experts: list[int]  # routed experts per layer (0: dense FFN)
    expert: list[Param]  # one routed expert's

    def numel(self) -> int:
        one = sum(p.numel for p in self.expert)
        return (
            sum(p.numel for p in self.first + self.last)
            + sum(p.numel for ps in self.layers for p in ps)
            + one * sum(self.experts)
        )


@dataclass(frozen=True)
class Layout:
    """How the GPUs are split: `pp` stages of `fsdp` ranks; `ep` of them share out the routed experts."""

    gpus: int
    pp: int
    fsdp: int
    ep: int

    def check(self, config: ModelConfig) -> None:
        for name in ("gpus", "pp", "fsdp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.pp * self.fsdp != self.gpus:
            raise ValueError(f"--gpus ({self.gpus}) must equal --pp x --fsdp ({self.pp} x {self.fsdp})")
        if self.pp > config.num_layers:
            raise ValueError(f"--pp ({self.pp}) must be at most the {config.num_layers} layers of {config.name}")
        if self.fsdp % self.ep:
            raise ValueError(f"--ep ({self.ep}) must divide --fsdp ({self.fsdp}): the experts are split inside a stage")
        moe = "moe" in config.mlp_types
        if not moe and self.ep != 1:
            raise ValueError(f"--ep {self.ep}: {config.name} has no MoE layers; use --ep 1")
        if moe and config.num_experts % self.ep:
            raise ValueError(f"--ep ({self.ep}) must divide the {config.num_experts} experts of each MoE layer")

    def stage_layers(self, num_layers: int, stage: int) -> range:
        """Decoder layers of pipeline stage `stage`: equal runs, the first stages one longer if uneven."""
        size, extra = divmod(num_layers, self.pp)
        start = stage * size + min(stage, extra)
        return range(start, start + size + (stage < extra))


def _kind(name: str, p: torch.Tensor) -> str:
    """By k3 train's own rule (`k3.training.muon.takes_muon`): Muon's hidden matrices, the embedding
    table and head, and the rest (norms, biases, gate parameters, conv kernels, AttnRes queries [1, d])."""
    from ..training.muon import takes_muon

    if "embed" in name or name.startswith("lm_head"):
        return "embedding"
    return "matrix" if takes_muon(name, p) else "vector"


def model_shapes(config: ModelConfig) -> ModelShapes:
    """The shapes of `config`'s parameters, from one decoder layer of each (mixer, FFN) kind and the
    root modules, all built on the meta device."""
    with torch.device("meta"):
        # the root: a one-layer model of the same config (its first layer kept), that layer left out
        one = dataclasses.replace(
            config, num_layers=1, layer_types=config.layer_types[:1], mlp_types=config.mlp_types[:1]
        )
        root = [(n, p) for n, p in CausalLM(one).named_parameters() if not n.startswith("model.layers.")]
        kinds: dict[tuple[str, str], tuple[list[Param], list[Param]]] = {}
        for i, key in enumerate(zip(config.layer_types, config.mlp_types)):
            if key not in kinds:
                named = list(DecoderLayer(config, i).named_parameters())
                other = [Param(tuple(p.shape), _kind(n, p)) for n, p in named if not n.startswith(EXPERTS_PREFIX)]
                expert = [Param(tuple(p.shape), "matrix") for n, p in named if n.startswith(EXPERTS_PREFIX + "0.")]
                kinds[key] = other, expert
    first = [Param(tuple(p.shape), _kind(n, p)) for n, p in root if n.startswith("model.embed_")]
    last = [Param(tuple(p.shape), _kind(n, p)) for n, p in root if not n.startswith("model.embed_")]
    layers = [kinds[key][0] for key in zip(config.layer_types, config.mlp_types)]
    experts = [config.num_experts if mlp == "moe" else 0 for mlp in config.mlp_types]
    expert = next((e for _, e in kinds.values() if e), [])
    return ModelShapes(first, last, layers, experts, expert)


def shard_rows(rows: int, size: int, index: int) -> int:
    """Rows of a `rows`-row parameter that FSDP2 gives rank `index` of `size` (torch.chunk's split)."""
    chunk = math.ceil(rows / size)
    return max(0, min(chunk, rows - index * chunk))


def _sharded(params: list[Param], size: int, index: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in params:
        rows, rest = (p.shape[0], math.prod(p.shape[1:])) if p.shape else (1, 1)
        out[p.kind] = out.get(p.kind, 0) + shard_rows(rows, size, index) * rest
    return out


def _add(total: dict[str, int], part: dict[str, int], times: int = 1) -> None:
    for key, n in part.items():
        total[key] = total.get(key, 0) + n * times


def rank_values(shapes: ModelShapes, layout: Layout, rank: int) -> dict[str, int]:
    """Parameter values held by global rank `rank` (stage rank // fsdp, rank rank % fsdp within it), by
    kind: "embedding", "matrix", "vector" and "routed experts"."""
    if not 0 <= rank < layout.gpus:
        raise ValueError(f"rank must be in [0, {layout.gpus}), got {rank}")
    stage, m = divmod(rank, layout.fsdp)
    held: dict[str, int] = {}
    if stage == 0:
        _add(held, _sharded(shapes.first, layout.fsdp, m))
    if stage == layout.pp - 1:
        _add(held, _sharded(shapes.last, layout.fsdp, m))
    experts = 0
    for i in layout.stage_layers(len(shapes.layers), stage):
        _add(held, _sharded(shapes.layers[i], layout.fsdp, m))
        experts += shapes.experts[i] // layout.ep
    mod_size, mod_index = layout.fsdp // layout.ep, m // layout.ep
    held["routed experts"] = experts * sum(_sharded(shapes.expert, mod_size, mod_index).values())
    return held


def unsharded_layer_values(shapes: ModelShapes, layout: Layout) -> int:
    """The most parameter values one rank all-gathers for one FSDP unit: a decoder layer (its own experts
    whole, the others' not at all) or the root's embeddings / head."""
    one = sum(p.numel for p in shapes.expert)
    layers = [sum(p.numel for p in ps) + n // layout.ep * one for ps, n in zip(shapes.layers, shapes.experts)]
    return max(layers + [sum(p.numel for p in shapes.first), sum(p.numel for p in shapes.last)])
