"""A run's data, model and optimizer, built for its processes: free functions over a `ParallelDims`
(k3.training.parallel), the same calls on one process and under torchrun (torchtitan builds its
trainer this way: meta init, parallelize, compile, optimizer).

- `prepare_data`: the tokenizer and token streams (rank 0 first: it may fetch the corpus and train the
  tokenizer; the others then read its tokenizer).
- `build_model`: the model on the meta device under torchrun, so each process allocates only what it
  holds (`parallelize` materialises it); whole where a checkpoint's weights will be loaded into it.
- `build`: the model onto its device, activation recompute, the split (FSDP2 for every torchrun mode),
  torch.compile, then the optimizer over this process's parameters; also the optimizer groups'
  parameter names as one process numbers them, which every checkpoint records whatever the split.
- `memory_share`: the part of the model's training state this machine's processes hold (the memory
  check before any work, `k3.training.config.model_config`).
"""

from __future__ import annotations

import torch

from ..models import CausalLM, count_params, get_config
from ..tokenizer import Tokenizer
from .config import TrainConfig
from .data import TokenData, prepare
from .optim import build_optimizer, group_names
from .parallel import ParallelDims, apply_recompute, compile_decoder, launch, parallelize


def prepare_data(
    cfg: TrainConfig, dims: ParallelDims, tokenizer: Tokenizer | None = None
) -> tuple[Tokenizer, TokenData]:
    """The run's tokenizer and token streams (k3.training.data.prepare): on rank 0 first, then on the
    others with rank 0's tokenizer (its error, if any, raised on every process)."""
    if dims.world == 1:
        return prepare(cfg, tokenizer)
    from tokenizers import Tokenizer as HFTokenizer

    data = None
    if dims.is_main:
        tokenizer, data = dims.on_main(lambda: prepare(cfg, tokenizer))
    else:
        dims.on_main(None)
    text = dims.share(tokenizer.inner.to_str() if dims.is_main else None)
    if data is None:
        tokenizer, data = prepare(cfg, Tokenizer(HFTokenizer.from_str(text)))
    return tokenizer, data


def memory_share(cfg: TrainConfig, dims: ParallelDims, whole: bool = False) -> float:
    """The part of the model's training state this machine's processes (torchrun's LOCAL_WORLD_SIZE)
    hold: all of it on one process and under ddp, each a 1/N shard under fsdp, the dense part whole and
    1/N of the experts under ep. `whole`: the model is built whole on every process first (a resumed
    run, to load it)."""
    if dims.world == 1:
        return 1.0
    local = launch().local_world
    if whole or dims.mode == "ddp":
        return float(local)
    if dims.shard_dense:
        return local / dims.world
    counts = count_params(get_config(cfg.preset, **cfg.model_overrides))
    experts = counts.breakdown.get("routed experts", 0) / counts.total
    return local * ((1 - experts) + experts / dims.world)


def build_model(config, dims: ParallelDims, whole: bool = False) -> CausalLM:
    """The model to train, initialised: under torchrun on the meta device (`build` splits it, then each
    process allocates and initialises only its share, with the one-process run's values) unless `whole`
    (its weights will be loaded from a checkpoint that holds them whole)."""
    if dims.world == 1 or whole:
        return CausalLM(config)
    with torch.device("meta"):
        return CausalLM(config)


def build(model: CausalLM, cfg: TrainConfig, dims: ParallelDims) -> tuple[torch.optim.Optimizer, list[list[str]]]:
    """Take `model` (the same on every process) for training as `dims` says, in place: onto the device,
    activation recompute (before the split, as torchtitan orders them), the split, torch.compile; then
    the optimizer over this process's parameters. Returns the optimizer and its groups' parameter names
    as one process numbers them (what checkpoints record)."""
    if cfg.async_checkpoint and dims.world == 1:
        raise ValueError(
            "k3 train: --async-checkpoint writes a sharded (DCP) checkpoint in the background: it needs "
            "torchrun with --parallel ddp, fsdp or ep; a one-process run saves in one piece (drop the flag)"
        )
    groups = None if dims.world == 1 else group_names(model, build_optimizer(model, cfg))  # before the split
    if not model.lm_head.weight.is_meta:
        model.to(dims.device)
    apply_recompute(model, cfg.recompute)
    if dims.world > 1:
        parallelize(model, dims, cfg.precision)
    if cfg.compile:
        compile_decoder(model, fullgraph=dims.world == 1)  # (the parallel modes' hooks run collectives)
    optimizer = build_optimizer(model, cfg)
    return optimizer, group_names(model, optimizer) if groups is None else groups
