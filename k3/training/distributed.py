"""`k3 train` on many processes: `torchrun --nproc_per_node=N -m k3 train ... --parallel ddp|fsdp|ep`.

Every mode keeps the single-process run's arithmetic. All ranks draw the same global batch from the
same data generator and each takes an equal contiguous slice of it; the mean of the ranks' losses is
then the global batch's loss and the mean of their gradients its gradient (up to the order of the
sums: equal to fp32 rounding, not bitwise).

How each mode splits the model is k3.training.parallel's (`parallelize`); what the step adds:

- **ddp**: every rank holds the whole model; DistributedDataParallel averages the gradients during
  the backward pass, so nothing is left to do.
- **fsdp**: each rank stores 1/N of the parameters, gradients and AdamW moments; FSDP2 reduce-scatters
  the gradients (zeros from a rank where no token chose an expert). An expert that no rank's tokens
  chose loses its gradient, as the single process leaves it without one.
- **ep**: rank r owns the routed experts [r E/N, (r+1) E/N) of every MoE layer and replicates everything
  else. The gradients of the replicated parameters are all-reduced by hand (averaged); an expert's
  gradient already sums all ranks' tokens on its owner and is divided by N. The gradient norm for
  clipping adds the experts' squared norms over the ranks.

The MoE balancing update uses the load summed over ranks, as the single process sees it; QK-Clip
(k3.training.qk_clip) takes each attention head's largest logit over ranks (MAX), so every rank scales
the same heads by the same factors (under fsdp, each its own rows of the sharded weights). Checkpoints
are the single-process ones (full tensors; the optimizer state in torch's own numbering), gathered to
rank 0 and written by it while the others wait for the outcome: a run resumes at any world size and
in any mode. On CPUs the processes talk through gloo; with CUDA, through NCCL, one GPU per process
(`device` "auto" or "cuda"; "cpu" keeps them on the CPUs; MPS has no multi-process backend).

Gradient accumulation (`grad_accum` N) splits each micro-batch over the ranks as the whole batch would
be: ddp skips its gradient all-reduce (`no_sync`) on all but the last micro-batch; fsdp reduce-scatters
after each (the shards' gradients add up); ep reduces by hand once, after the last.
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
    build_optimizer, flat_names, group_names, load_keeping_implementation, named_state, numbered_state,
)
from .parallel import apply_recompute, check_expert_split, held_expert_parameters, parallelize
from .strategy import SingleProcess, compile_decoder, to_cpu

__all__ = ["MODES", "Distributed", "check_expert_split", "start"]

MODES = ("none", "ddp", "fsdp", "ep")
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


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
            raise ValueError(f"--parallel none, but torchrun started {world} processes (WORLD_SIZE={world}): each "
                             f"would train the same model and write the same checkpoint; use --parallel ddp, fsdp or ep")
        return None
    missing = [name for name in _TORCHRUN_ENV if name not in os.environ]
    if missing:
        raise ValueError(f"--parallel {mode} runs under torchrun (missing {', '.join(missing)} in the environment): "
                         f"torchrun --nproc_per_node=N -m k3 train ... --parallel {mode}")
    if batch_size % world:
        raise ValueError(f"--batch-size must be a multiple of the {world} processes (each takes an equal share of "
                         f"the global batch), got {batch_size}")
    return Distributed(mode, device, ep)


class Distributed(SingleProcess):
    """This process's part in a torchrun job: rank, world size, device, and how the model is split."""

    def __init__(self, mode: str, device: str = "auto", ep: int = 1):
        if device == "mps":
            raise ValueError(f"--device mps: --parallel {mode} runs its processes on CUDA GPUs (NCCL) or CPUs "
                             f"(gloo); MPS has no multi-process backend. Use --device cpu, or one process")
        super().__init__("cpu" if device == "auto" else device)  # (checks that a named device exists)
        self.mode, self.ep = mode, ep
        self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if device != "cpu" and torch.cuda.is_available():
            self.device, backend = torch.device("cuda", int(os.environ["LOCAL_RANK"])), "nccl"
            torch.cuda.set_device(self.device)
        else:
            self.device, backend = torch.device("cpu"), "gloo"
        self._owns_group = not dist.is_initialized()  # a caller's process group is left to the caller
        if self._owns_group:
            dist.init_process_group(backend)
        self.is_main = self.rank == 0

    def describe(self) -> str:
        mode = f"fsdp x ep {self.ep}" if self.ep > 1 else self.mode
        return f" in each of {self.world_size} processes ({mode})"

    def close(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()

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
        under ep. `whole`: the model is built whole on every process first (a resumed run, to load it)."""
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        if whole or self.mode == "ddp":
            return float(local)
        if self.mode == "fsdp":
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
        self.model = model if model.lm_head.weight.is_meta else model.to(self.device)
        self.precision = cfg.precision
        apply_recompute(model, cfg.recompute)  # before the sharding, as torchtitan orders them
        self.net = parallelize(model, self.mode, self.device, self.ep)
        if cfg.compile:
            compile_decoder(model)
        self.optimizer = build_optimizer(model, cfg)
        self._expert_params = {id(p) for p in held_expert_parameters(model)}
        self._expert_names = {n for n, p in model.named_parameters() if id(p) in self._expert_params}
        # the group the experts are split over (None: all ranks, --parallel ep)
        self._ep_group = model.moe_layers()[0].experts.ep_group if self.ep > 1 else None

    # -- the training step's hooks ----------------------------------------------------------------------
    def local_batch(self, windows: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous share of the global batch [B, T + 1]."""
        b = windows.shape[0] // self.world_size
        return windows[self.rank * b:(self.rank + 1) * b].to(self.device)

    def accumulating(self, last: bool):
        """ddp: no gradient all-reduce before the step's last micro-batch (the gradients add up locally)."""
        if self.mode == "ddp" and not last:
            return self.net.no_sync()
        return super().accumulating(last)

    def sum_over_processes(self, loss: torch.Tensor, moes: list) -> tuple[float, list[torch.Tensor]]:
        """One all-reduce for the loss and the expert loads of every MoE layer, summed over ranks."""
        stats = torch.cat([loss.detach().double().view(1)] + [m.last_load.double() for m in moes])
        dist.all_reduce(stats)
        return stats[0].item() / self.world_size, list(stats[1:].split([m.last_load.numel() for m in moes]))

    def synchronize_gradients(self, loads: list[torch.Tensor]) -> None:
        if self.mode == "ep":
            self._reduce_gradients()
        elif self.mode == "fsdp":  # the single process leaves an expert no token chose without a gradient
            for moe, load in zip(self.model.moe_layers(), loads):
                for e in torch.nonzero(load == 0).flatten().tolist():
                    if moe.experts[e] is not None:  # (None: held by another ep group)
                        for p in moe.experts[e].parameters():
                            p.grad = None

    def _reduce_gradients(self) -> None:
        """ep: average the replicated parameters' gradients over ranks (one flat all-reduce); an owned
        expert's gradient holds d(sum of the ranks' losses), so it is divided by the world size. A
        replicated parameter without a gradient has none on every rank (the same graph runs everywhere)."""
        params = list(self.model.parameters())
        shared = [p for p in params if p.grad is not None and id(p) not in self._expert_params]
        flat = torch.cat([p.grad.reshape(-1) for p in shared])
        dist.all_reduce(flat)
        flat /= self.world_size
        for p, g in zip(shared, flat.split([p.numel() for p in shared])):
            p.grad.copy_(g.view_as(p))
        for p in params:
            if p.grad is not None and id(p) in self._expert_params:
                p.grad /= self.world_size

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        if self.mode == "ep" or self.ep > 1:
            return self._clip_with_split_experts(max_norm)
        # ddp: the gradients are the same on every rank; fsdp: DTensors know their shards
        return super().clip_gradients(max_norm)

    def _clip_with_split_experts(self, max_norm: float) -> torch.Tensor:
        """ep and fsdp x ep: each rank of an ep group holds other experts, so the norm adds the dense part's
        square (the same on every rank; under fsdp whole from its DTensors) to the experts' squares summed
        over the ep group (torchtitan's clipping with ep); each mesh's gradients are scaled apart."""
        from torch.distributed.tensor import DTensor

        def whole(norm):
            return norm.full_tensor() if isinstance(norm, DTensor) else norm

        params = [p for p in self.model.parameters() if p.grad is not None]
        experts = [p for p in params if id(p) in self._expert_params]
        dense = [p for p in params if id(p) not in self._expert_params]
        squares = []
        for part in (dense, experts):
            norm = whole(torch.nn.utils.get_total_norm([p.grad for p in part])) if part else torch.zeros(())
            squares.append((norm.to(self.device, torch.float32) ** 2).reshape(1).clone())
        dist.all_reduce(squares[1], group=self._ep_group)
        norm = (squares[0] + squares[1])[0].sqrt()
        for part in (dense, experts):
            if part:
                torch.nn.utils.clip_grads_with_norm_(part, max_norm, norm)
        return norm

    def max_over_processes(self, values: torch.Tensor) -> torch.Tensor:
        """Each head's largest logit over all ranks (a MAX all-reduce): every rank clips alike."""
        values = values.to(self.device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        return values

    # -- evaluation's hooks ---------------------------------------------------------------------------
    def local_windows(self, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An equal share of the windows for each rank, the last share padded with repeats that are not
        counted (fsdp and ep need the same calls everywhere)."""
        n = windows.shape[0]
        per_rank = -(-n // self.world_size)
        index = torch.arange(self.rank * per_rank, (self.rank + 1) * per_rank)
        return windows[index.clamp(max=n - 1)], index < n

    def sum_totals(self, nats: float, nbytes: int) -> tuple[float, float]:
        totals = torch.tensor([nats, nbytes], dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)
        return totals[0].item(), totals[1].item()

    # -- checkpoints ----------------------------------------------------------------------------------
    def save(self, out, tokenizer: Tokenizer, cfg: TrainConfig, step: int, max_steps: int | None,
             generator: torch.Generator, history: dict) -> None:
        """ddp: the single-process checkpoint, written by rank 0. fsdp and ep: a sharded one, each rank
        writing its own shards (k3.training.sharded), committed by rank 0."""
        if self.mode == "ddp":
            return super().save(out, tokenizer, cfg, step, max_steps, generator, history)
        from .sharded import save_sharded

        self._reshard()
        save_sharded(self, Path(out), tokenizer, cfg, step, max_steps, generator, history)

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
                StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
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
        state = {n: {k: whole(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                 for n, s in local["state"].items()}
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
            set_optimizer_state_dict(self.model, self.optimizer,
                                     named_state(saved, flat_names(group_names(self.model, self.optimizer))),
                                     options=StateDictOptions(full_state_dict=True, strict=False))
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
                state[name] = {k: distribute_tensor(v.to(self.device), p.device_mesh, p.placements,
                                                    src_data_rank=None)
                               if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.shape == p.shape
                               else v for k, v in full["state"][name].items()}
            mine = {"state": state,
                    "param_groups": [{**g, "params": names} for g, names in zip(full["param_groups"], groups)]}
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

