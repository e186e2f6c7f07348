"""`k3 train` on many processes: `torchrun --nproc_per_node=N -m k3 train ... --parallel ddp|fsdp|ep`.

Every mode keeps the single-process run's arithmetic: the training step is k3.training.step's
`train_step`, the same function one process calls, given this process's `ParallelDims`
(k3.training.parallel: its share of the batch, the sums and maxima over processes). How each mode
splits the model is k3.training.parallel's (`parallelize`):

- **ddp**: every rank holds the whole model; DistributedDataParallel averages the gradients during
  the backward pass (and skips it, `no_sync`, before the last micro-batch of an accumulated step).
- **fsdp**: each rank stores 1/N of the parameters, gradients and AdamW moments; FSDP2 reduce-scatters
  the gradients after each micro-batch (zeros from a rank where no token chose an expert). An expert
  that no rank's tokens chose loses its gradient, as the single process leaves it without one.
- **fsdp --ep N**: the routed experts split over groups of N ranks besides, each expert sharded over
  the world / N ranks that hold it; the gradient norm for clipping adds the experts' squared norms
  over the ep group.
- **ep**: an alias of fsdp x ep with the experts split over all ranks and the dense parameters held
  whole by every rank (an fsdp size of 1: FSDP2 all-reduces their gradients); the same steps.

The MoE balancing update uses the load summed over ranks, as the single process sees it; QK-Clip
(k3.training.qk_clip) takes each attention head's largest logit over ranks (MAX), so every rank scales
the same heads by the same factors (under fsdp, each its own rows of the sharded weights). ddp
checkpoints are the single-process ones (full tensors; the optimizer state in torch's own numbering),
gathered to rank 0 and written by it while the others wait for the outcome; fsdp (and ep) checkpoints
are sharded, each rank writing its own shards (k3.training.sharded). Either resumes at any world size
and in any mode. On CPUs the processes talk through gloo; with CUDA, through NCCL, one GPU per process
(`device` "auto" or "cuda"; "cpu" keeps them on the CPUs; MPS has no multi-process backend).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from ..models import CausalLM
from ..tokenizer import Tokenizer
from .config import TrainConfig
from .data import TokenData, prepare
from .optim import (
    build_optimizer,
    flat_names,
    group_names,
    load_keeping_implementation,
    named_state,
    numbered_state,
)
from .parallel import (
    MODES,
    TORCHRUN_ENV,
    apply_recompute,
    check_expert_split,
    held_expert_parameters,
    init_parallel,
    parallelize,
)
from .strategy import SingleProcess, compile_decoder, to_cpu

__all__ = ["MODES", "Distributed", "check_expert_split", "start"]


def start(mode: str, batch_size: int, device: str = "auto", ep: int = 1) -> "Distributed | None":
    """The Distributed strategy of this process for `mode` ("none": None, a single-process run). The
    other modes read torchrun's environment; the global batch (a micro-batch of it, with gradient
    accumulation) must split evenly over the processes."""
    if mode not in MODES:
        raise ValueError(f"--parallel must be one of {', '.join(MODES)}, got {mode!r}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if ep != 1 and mode != "fsdp":
        raise ValueError(f"--ep {ep} is for --parallel fsdp (fsdp x expert parallelism), not --parallel {mode}")
    if mode == "none":
        if world > 1:
            raise ValueError(
                f"--parallel none, but torchrun started {world} processes (WORLD_SIZE={world}): each "
                f"would train the same model and write the same checkpoint; use --parallel ddp, fsdp or ep"
            )
        return None
    missing = [name for name in TORCHRUN_ENV if name not in os.environ]
    if missing:
        raise ValueError(
            f"--parallel {mode} runs under torchrun (missing {', '.join(missing)} in the environment): "
            f"torchrun --nproc_per_node=N -m k3 train ... --parallel {mode}"
        )
    if batch_size % world:
        raise ValueError(
            f"--batch-size must be a multiple of the {world} processes (each takes an equal share of "
            f"the global batch), got {batch_size}"
        )
    return Distributed(mode, device, ep)


class Distributed(SingleProcess):
    """This process's part in a torchrun job: its `dims` (rank, world size, device, mesh) and how the
    model is split (`mode` "ddp" or "fsdp"; "ep" is fsdp with the experts split over all ranks)."""

    def __init__(self, mode: str, device: str = "auto", ep: int = 1):
        from ..runtime import exit_with_launcher

        exit_with_launcher()  # a torchrun worker ends with its launcher, not training on as an orphan
        super().__init__("cpu")
        self.dims, self._owns_group = init_parallel(mode, device, ep)
        self.mode, self.ep = self.dims.mode, self.dims.ep
        self._pending = None  # an asynchronous save being written (k3.training.sharded.PendingSave)
        self._save_group = None  # its writers' gloo group (--async-checkpoint)

    def describe(self) -> str:
        return f" in each of {self.world_size} processes ({self.dims.describe()})"

    def close(self) -> None:
        self.finish_save()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()

    def poll_save(self) -> None:
        """Commit the asynchronous save once every process has written its files (one flag all-reduced
        a step while one is pending)."""
        if self._pending is not None and not self.any(not self._pending.done()):
            self.finish_save()

    def finish_save(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.finish()

    # -- data and model -------------------------------------------------------------------------------
    def prepare(self, cfg: TrainConfig, tokenizer: Tokenizer | None = None) -> tuple[Tokenizer, TokenData]:
        """`prepare` on rank 0 first (it may fetch the corpus and trains the tokenizer), then on the
        others with rank 0's tokenizer."""
        from tokenizers import Tokenizer as HFTokenizer

        data = None
        if self.is_main:
            tokenizer, data = self.on_main(lambda: prepare(cfg, tokenizer))
        else:
            self.on_main(None)
        text = self.share(tokenizer.inner.to_str() if self.is_main else None)
        if data is None:
            tokenizer, data = prepare(cfg, Tokenizer(HFTokenizer.from_str(text)))
        return tokenizer, data

    def share_here(self, cfg: TrainConfig, whole: bool = False) -> float:
        """The part of the model's training state this machine's processes (torchrun's LOCAL_WORLD_SIZE)
        hold: each a 1/N shard under fsdp, everything under ddp, the dense part and 1/N of the experts
        under ep (dense whole). `whole`: the model is built whole on every process first (a resumed run, to load it)."""
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        if whole or self.mode == "ddp":
            return float(local)
        if self.dims.shard_dense:
            return local / self.world_size
        from ..models import count_params, get_config

        counts = count_params(get_config(cfg.preset, **cfg.model_overrides))
        experts = counts.breakdown.get("routed experts", 0) / counts.total
        return local * ((1 - experts) + experts / self.world_size)

    def new_model(self, config, to_load: bool = False) -> CausalLM:
        """On the meta device: `setup` splits it, then each process allocates and initialises only its
        share (k3.training.parallel), with the one-process run's values. A model whose weights will be
        loaded (a resumed run: its checkpoint holds them whole) is built whole."""
        if to_load:
            return CausalLM(config)
        with torch.device("meta"):
            return CausalLM(config)

    def setup(self, model: CausalLM, cfg: TrainConfig) -> None:
        """Split `model` (a CausalLM, the same on every rank) for this mode (k3.training.parallel) and
        build the optimizer over this rank's parameters."""
        self._full_groups = group_names(model, build_optimizer(model, cfg))  # the single-process numbering
        if cfg.async_checkpoint:
            if self.mode == "ddp":
                raise ValueError(
                    "k3 train: --async-checkpoint writes a sharded (DCP) checkpoint in the background: it "
                    "needs --parallel fsdp or ep (ddp saves one whole checkpoint from rank 0)"
                )
            # torchtitan's way: the background writes' collectives on a gloo group of their own
            self._save_group = dist.new_group(backend="gloo")
        self.model = model if model.lm_head.weight.is_meta else model.to(self.device)
        self.precision = cfg.precision
        apply_recompute(model, cfg.recompute)  # before the sharding, as torchtitan orders them
        self.net = parallelize(model, self.dims, cfg.precision)
        if cfg.compile:
            compile_decoder(model)
        self.optimizer = build_optimizer(model, cfg)
        held = {id(p) for p in held_expert_parameters(model)}
        self._expert_names = {n for n, p in model.named_parameters() if id(p) in held}

    # -- checkpoints ----------------------------------------------------------------------------------
    def save(
        self,
        out,
        tokenizer: Tokenizer,
        cfg: TrainConfig,
        step: int,
        max_steps: int | None,
        generator: torch.Generator,
        history: dict,
    ) -> None:
        """ddp: the single-process checkpoint, written by rank 0. fsdp and ep: a sharded one, each rank
        writing its own shards (k3.training.sharded), committed by rank 0."""
        if self.mode == "ddp":
            return super().save(out, tokenizer, cfg, step, max_steps, generator, history)
        from .sharded import save_sharded

        self.finish_save()  # one save at a time, in order
        self._reshard()
        self._pending = save_sharded(
            self, Path(out), tokenizer, cfg, step, max_steps, generator, history, cfg.async_checkpoint, self._save_group
        )

    def saved_groups(self) -> list[list[str]]:
        return self._full_groups

    def _reshard(self) -> None:
        """After a forward without backward (an evaluation) FSDP's root stays unsharded: shard it again,
        so that state dicts hold the shards."""
        from torch.distributed.fsdp import FSDPModule

        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def full_state(self) -> tuple[dict | None, dict | None]:
        """Rank 0: the single-process model state dict and optimizer state dict, on the CPU; others: None."""
        model, optimizer = self.model, self.optimizer
        if self.mode == "ddp":
            if not self.is_main:
                return None, None
            return to_cpu(model.state_dict()), to_cpu(optimizer.state_dict())
        if self.mode == "fsdp" and self.ep == 1:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
                get_optimizer_state_dict,
            )

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            weights = get_model_state_dict(model, options=options)
            named = get_optimizer_state_dict(model, optimizer, options=options)
            return (weights, numbered_state(named)) if self.is_main else (None, None)
        return self._gathered_state()

    def _gathered_state(self) -> tuple[dict | None, dict | None]:
        """ep and fsdp x ep: every sharded tensor made whole over its own mesh (under fsdp: dense over all
        ranks, each expert over its efsdp ranks), then rank 0 takes the experts it does not hold, with
        their optimizer states, from the other ranks."""
        from torch.distributed.tensor import DTensor

        def whole(t):
            return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()

        model, optimizer = self.model, self.optimizer
        self._reshard()
        names = flat_names(group_names(model, optimizer))
        weights = {n: whole(t) for n, t in model.state_dict().items()}
        local = named_state(optimizer.state_dict(), names)
        state = {
            n: {k: whole(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for n, s in local["state"].items()
        }
        if not self.is_main:  # the dense rest, and rank 0's own experts, are rank 0's
            weights = {n: t for n, t in weights.items() if n in self._expert_names}
            state = {n: s for n, s in state.items() if n in self._expert_names}
        parts = [None] * self.world_size if self.is_main else None
        dist.gather_object((weights, state), parts, dst=0)
        if not self.is_main:
            return None, None
        weights, state = {}, {}
        for part_weights, part_state in parts:
            for n, t in part_weights.items():
                weights.setdefault(n, t)
            for n, s in part_state.items():
                state.setdefault(n, s)
        groups = [{**g, "params": names} for g, names in zip(local["param_groups"], self._full_groups)]
        return weights, numbered_state({"state": state, "param_groups": groups})

    def load_optimizer(self, saved: dict) -> None:
        """Load a single-process optimizer state dict (full tensors, torch's numbering) into this rank's part."""
        load_keeping_implementation(self.optimizer, lambda: self._load_optimizer(saved))

    def _load_optimizer(self, saved: dict) -> None:
        if self.mode == "ddp":
            self.optimizer.load_state_dict(saved)
        elif self.mode == "fsdp" and self.ep == 1:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            # strict=False: a parameter without a state (an expert no token chose yet) stays without one
            set_optimizer_state_dict(
                self.model,
                self.optimizer,
                named_state(saved, flat_names(group_names(self.model, self.optimizer))),
                options=StateDictOptions(full_state_dict=True, strict=False),
            )
        else:  # ep, fsdp x ep: this rank's parameters' states, each placed as its parameter is
            from torch.distributed.tensor import DTensor, distribute_tensor

            full = named_state(saved, flat_names(self._full_groups))
            groups = group_names(self.model, self.optimizer)
            params = dict(self.model.named_parameters())
            state = {}
            for name in flat_names(groups):
                if name not in full["state"]:
                    continue
                p = params[name]
                state[name] = {
                    k: distribute_tensor(v.to(self.device), p.device_mesh, p.placements, src_data_rank=None)
                    if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.shape == p.shape
                    else v
                    for k, v in full["state"][name].items()
                }
            mine = {
                "state": state,
                "param_groups": [{**g, "params": names} for g, names in zip(full["param_groups"], groups)],
            }
            self.optimizer.load_state_dict(numbered_state(mine))

    # -- agreement ------------------------------------------------------------------------------------
    def on_main(self, work):
        """Run `work` on rank 0 (the others pass None) and raise its error, if any, on every rank: no
        rank waits forever for one that has given up."""
        result, error = None, None
        if self.is_main:
            try:
                result = work()
            except Exception as e:
                error = e
        error = self.share(error)
        if error is not None:
            raise error
        return result

    def share(self, value):
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, value) -> list | None:
        parts = [None] * self.world_size if self.is_main else None
        dist.gather_object(value, parts, dst=0)
        return parts

    def any(self, flag: bool) -> bool:
        t = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())
