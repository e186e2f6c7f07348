"""`k3 train` on many processes: `torchrun --nproc_per_node=N -m k3 train ... --parallel ddp|fsdp|ep`.

Every mode keeps the single-process run's arithmetic. All ranks draw the same global batch from the
same data generator and each takes an equal contiguous slice of it; the mean of the ranks' losses is
then the global batch's loss and the mean of their gradients its gradient (up to the order of the
sums: equal to fp32 rounding, not bitwise).

- **ddp**: every rank holds the whole model; DistributedDataParallel averages the gradients during
  the backward pass.
- **fsdp**: FSDP2 `fully_shard` on every decoder layer, then on the root: each rank stores 1/N of the
  parameters, gradients and AdamW moments and all-gathers a layer's weights just before using them.
- **ep**: expert parallelism. Rank r owns the routed experts [r E/N, (r+1) E/N) of every MoE layer (the
  other entries of `experts` are None) and replicates everything else. In each MoE layer the ranks
  all-gather their routed tokens (latent z, chosen experts, weights), each runs its own experts on
  every token routed to them, and a reduce-scatter sums the N partial outputs and hands each rank
  back its own tokens' rows: an all-reduce of the combined output, each rank keeping its rows. The
  gradients of the replicated parameters are all-reduced by hand (averaged); an expert's gradient
  already sums all ranks' tokens on its owner and is divided by N.

The MoE balancing update uses the load summed over ranks, as the single process sees it. Checkpoints
are the single-process ones (full tensors; the optimizer state in torch's own numbering), gathered to
rank 0 and written by it while the others wait for the outcome: a run resumes at any world size and
in any mode. On CPUs the processes talk through gloo; with CUDA, through NCCL, one GPU per process.
"""

from __future__ import annotations

import math
import os
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

MODES = ("none", "ddp", "fsdp", "ep")
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def start(mode: str, batch_size: int) -> "Parallel | None":
    """The Parallel of this process for `mode` ("none": None, a single-process run). The other modes
    read torchrun's environment; the global batch must split evenly over the processes."""
    if mode not in MODES:
        raise ValueError(f"--parallel must be one of {', '.join(MODES)}, got {mode!r}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
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
    return Parallel(mode)


def check_expert_split(config, world_size: int) -> None:
    """Expert parallelism needs MoE layers whose experts split evenly over the processes."""
    if "moe" not in config.mlp_types:
        raise ValueError(f"--parallel ep needs a model with MoE layers; {config.name} has none (use ddp or fsdp)")
    if config.num_experts % world_size:
        raise ValueError(f"--parallel ep: the {config.num_experts} experts of each MoE layer do not split evenly "
                         f"over {world_size} processes; use a process count that divides {config.num_experts}")


class Parallel:
    """This process's part in a torchrun job: rank, world size, device, and how the model is split."""

    def __init__(self, mode: str):
        self.mode = mode
        self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if torch.cuda.is_available():
            self.device, backend = torch.device("cuda", int(os.environ["LOCAL_RANK"])), "nccl"
            torch.cuda.set_device(self.device)
        else:
            self.device, backend = torch.device("cpu"), "gloo"
        self._owns_group = not dist.is_initialized()  # a caller's process group is left to the caller
        if self._owns_group:
            dist.init_process_group(backend)
        self.is_main = self.rank == 0
        self.model: nn.Module | None = None

    def close(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()

    # -- the model --------------------------------------------------------------------------------
    def setup(self, model: nn.Module, build_optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Split `model` (a CausalLM, the same on every rank) for this mode; returns the module to call
        in training and its optimizer, `build_optimizer(model)` over this rank's parameters."""
        self.model = model.to(self.device)
        if self.mode == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            # an expert that none of a rank's tokens chose has no gradient there
            net = DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                                          find_unused_parameters=bool(model.moe_layers()))
            return net, build_optimizer(model)
        self._broadcast_from_main(model)  # ddp does this itself
        if self.mode == "fsdp":
            self._fully_shard(model)
        else:
            check_expert_split(model.config, self.world_size)
            self._full_groups = self._group_names(build_optimizer(model))  # the single-process numbering
            self._shard_experts(model)
        return model, build_optimizer(model)

    def _broadcast_from_main(self, model: nn.Module) -> None:
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)

    def _fully_shard(self, model: nn.Module) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(self.device.type, (self.world_size,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if model.moe_layers():
            if not hasattr(model, "set_reduce_scatter_unused_params"):
                raise RuntimeError(f"--parallel fsdp with MoE layers needs FSDPModule.set_reduce_scatter_unused_params "
                                   f"(torch {torch.__version__} lacks it): an expert none of a rank's tokens chose has "
                                   f"no gradient there, and FSDP's reduce-scatter needs the same tensors on every rank")
            model.set_reduce_scatter_unused_params(True)  # zeros; globally unused experts go back to None
        # k3 adds every sub-layer's output out of place, so the in-place hazard this warns of cannot arise
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")

    def _shard_experts(self, model: nn.Module) -> None:
        self._expert_params: set[int] = set()
        for moe in model.moe_layers():
            per_rank = len(moe.experts) // self.world_size
            own = range(self.rank * per_rank, (self.rank + 1) * per_rank)
            for e in range(len(moe.experts)):
                if e in own:
                    self._expert_params.update(id(p) for p in moe.experts[e].parameters())
                else:
                    moe.experts[e] = None
            moe.experts.register_forward_pre_hook(self._gather_tokens)
            moe.experts.register_forward_hook(self._combine_outputs)
        self._expert_names = {n for n, p in model.named_parameters() if id(p) in self._expert_params}

    def _gather_tokens(self, experts: nn.Module, args: tuple) -> tuple:
        """Before the routed experts: every rank's tokens, in rank order."""
        z, chosen, weights, _ = args
        chosen = _GatherRows.apply(chosen)
        counts = torch.bincount(chosen.flatten(), minlength=len(experts))
        return _GatherRows.apply(z), chosen, _GatherRows.apply(weights), counts

    def _combine_outputs(self, experts: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        """After them: the sum over ranks of each one's experts' outputs, this rank's rows."""
        return _SumScatterRows.apply(out)

    # -- a training step ----------------------------------------------------------------------------
    def local_batch(self, windows: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous share of the global batch [B, T + 1]."""
        b = windows.shape[0] // self.world_size
        return windows[self.rank * b:(self.rank + 1) * b].to(self.device)

    def training_step(self, net: nn.Module, optimizer: torch.optim.Optimizer, windows: torch.Tensor, cfg) -> float:
        """`loop.training_step` on the global batch `windows`, split over the ranks; returns its loss."""
        from .loop import next_token_loss

        model = self.model
        loss = next_token_loss(net, self.local_batch(windows))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        # one all-reduce for the loss and the expert loads of every MoE layer, summed over ranks
        moes = model.moe_layers()
        stats = torch.cat([loss.detach().double().view(1)] + [m.last_load.double() for m in moes])
        dist.all_reduce(stats)
        loads = stats[1:].split([m.last_load.numel() for m in moes])
        if self.mode == "ep":
            self._reduce_gradients(model)
        elif self.mode == "fsdp":  # the single process leaves an expert no token chose without a gradient
            for moe, load in zip(moes, loads):
                for e in torch.nonzero(load == 0).flatten().tolist():
                    for p in moe.experts[e].parameters():
                        p.grad = None
        self._clip_gradients(model, cfg.grad_clip)
        optimizer.step()
        for moe, load in zip(moes, loads):
            moe.update_bias(load, rate=cfg.moe_bias_rate)
        return stats[0].item() / self.world_size

    def _reduce_gradients(self, model: nn.Module) -> None:
        """ep: average the replicated parameters' gradients over ranks (one flat all-reduce); an owned
        expert's gradient holds d(sum of the ranks' losses), so it is divided by the world size. A
        replicated parameter without a gradient has none on every rank (the same graph runs everywhere)."""
        shared = [p for p in model.parameters() if p.grad is not None and id(p) not in self._expert_params]
        flat = torch.cat([p.grad.reshape(-1) for p in shared])
        dist.all_reduce(flat)
        flat /= self.world_size
        for p, g in zip(shared, flat.split([p.numel() for p in shared])):
            p.grad.copy_(g.view_as(p))
        for p in model.parameters():
            if p.grad is not None and id(p) in self._expert_params:
                p.grad /= self.world_size

    def _clip_gradients(self, model: nn.Module, max_norm: float) -> None:
        if self.mode != "ep":  # ddp: the gradients are the same on every rank; fsdp: DTensors know their shards
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            return
        params = [p for p in model.parameters() if p.grad is not None]
        shared = torch.nn.utils.get_total_norm([p.grad for p in params if id(p) not in self._expert_params])
        experts = torch.nn.utils.get_total_norm([p.grad for p in params if id(p) in self._expert_params]) ** 2
        dist.all_reduce(experts)  # each rank holds a different slice of the experts
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, (shared ** 2 + experts).sqrt())

    # -- agreement and evaluation -------------------------------------------------------------------
    def share(self, value):
        """Rank 0's `value` on every rank (a decision only one clock should make)."""
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on some rank."""
        t = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    @torch.no_grad()
    def bits_per_byte(self, data, windows: torch.Tensor, batch_size: int = 16) -> float:
        """`loop.bits_per_byte` over all ranks: each evaluates an equal share of the windows (the last
        share padded with repeats that are not counted: fsdp and ep need the same calls everywhere)."""
        model, n = self.model, windows.shape[0]
        per_rank = -(-n // self.world_size)
        index = torch.arange(self.rank * per_rank, (self.rank + 1) * per_rank)
        counted, mine = index < n, windows[index.clamp(max=n - 1)]
        was_training = model.training
        model.eval()
        totals = torch.zeros(2, dtype=torch.float64)  # nats, bytes
        for w, keep in zip(mine.split(batch_size), counted.split(batch_size)):
            logits = model(w[:, :-1].to(self.device)).float()
            nats = F.cross_entropy(logits.transpose(1, 2), w[:, 1:].to(self.device), reduction="none")  # [b, T]
            totals[0] += nats[keep.to(self.device)].sum().item()
            totals[1] += int(data.token_bytes[w[keep][:, 1:]].sum())
        model.train(was_training)
        totals = totals.to(self.device)
        dist.all_reduce(totals)
        return totals[0].item() / math.log(2) / max(1.0, totals[1].item())

    # -- data and checkpoints -----------------------------------------------------------------------
    def prepare(self, cfg, tokenizer):
        """`loop.prepare` on rank 0 first (it may fetch the corpus and trains the tokenizer), then on
        the others with rank 0's tokenizer."""
        from tokenizers import Tokenizer as HFTokenizer

        from .loop import prepare
        from ..tokenizer import Tokenizer

        data = None
        if self.is_main:
            tokenizer, data = self._outcome(lambda: prepare(cfg, tokenizer))
        else:
            self._outcome(None)
        text = self.share(tokenizer.inner.to_str() if self.is_main else None)
        if data is None:
            tokenizer, data = prepare(cfg, Tokenizer(HFTokenizer.from_str(text)))
        return tokenizer, data

    def _outcome(self, work):
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

    def save_checkpoint(self, out, model, optimizer, tokenizer, cfg, step, max_steps, generator, history) -> None:
        """`save_training_checkpoint` of the whole model and optimizer, written by rank 0."""
        from ..models.checkpoint import weights_to_save
        from .checkpoint import save_training_checkpoint

        weights, optimizer_state = self._full_state(model, optimizer)
        self._outcome(lambda: save_training_checkpoint(
            out, model, optimizer, tokenizer, cfg, step, max_steps, generator, history,
            weights=weights_to_save(model, weights), optimizer_state=optimizer_state))

    def _full_state(self, model, optimizer) -> tuple[dict | None, dict | None]:
        """Rank 0: the single-process model state dict and optimizer state dict, on the CPU; others: None."""
        if self.mode == "ddp":
            if not self.is_main:
                return None, None
            return _to_cpu(model.state_dict()), _to_cpu(optimizer.state_dict())
        if self.mode == "fsdp":
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
            )

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            weights = get_model_state_dict(model, options=options)
            named = get_optimizer_state_dict(model, optimizer, options=options)
            return (weights, _numbered(named)) if self.is_main else (None, None)
        # ep: rank 0 collects the other ranks' experts and their AdamW moments
        local = _named(_to_cpu(optimizer.state_dict()), _flat(self._group_names(optimizer)))
        weights = _to_cpu(model.state_dict())
        if not self.is_main:  # the replicated rest is rank 0's own
            weights = {n: t for n, t in weights.items() if n in self._expert_names}
            local["state"] = {n: s for n, s in local["state"].items() if n in self._expert_names}
        parts = [None] * self.world_size if self.is_main else None
        dist.gather_object((weights, local["state"]), parts, dst=0)
        if not self.is_main:
            return None, None
        weights, state = {}, {}
        for part_weights, part_state in parts:
            weights.update(part_weights)
            state.update(part_state)
        groups = [{**g, "params": names} for g, names in zip(local["param_groups"], self._full_groups)]
        return weights, _numbered({"state": state, "param_groups": groups})

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, saved: dict) -> None:
        """Load a single-process optimizer state dict (full tensors, torch's numbering) into this rank's part."""
        if self.mode == "ddp":
            optimizer.load_state_dict(saved)
        elif self.mode == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(self.model, optimizer, _named(saved, _flat(self._group_names(optimizer))),
                                     options=StateDictOptions(full_state_dict=True))
        else:
            full = _named(saved, _flat(self._full_groups))
            groups = self._group_names(optimizer)
            own = set(_flat(groups))
            mine = {"state": {n: s for n, s in full["state"].items() if n in own},
                    "param_groups": [{**g, "params": names} for g, names in zip(full["param_groups"], groups)]}
            optimizer.load_state_dict(_numbered(mine))

    def _group_names(self, optimizer: torch.optim.Optimizer) -> list[list[str]]:
        name = {id(p): n for n, p in self.model.named_parameters()}
        return [[name[id(p)] for p in group["params"]] for group in optimizer.param_groups]


class _GatherRows(torch.autograd.Function):
    """[n, ...] on each rank -> [world * n, ...], the ranks' rows in rank order. Backward: the
    gradient of this rank's rows summed over the ranks (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty((dist.get_world_size() * x.shape[0], *x.shape[1:]))
        _all_gather(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(), *grad.shape[1:]))
        _reduce_scatter(out, grad.contiguous())
        return out


class _SumScatterRows(torch.autograd.Function):
    """[world * n, ...] on each rank -> its rows [n, ...] of the sum over ranks (a reduce-scatter).
    Backward: every rank's gradient of its rows, gathered (an all-gather)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty((x.shape[0] // dist.get_world_size(), *x.shape[1:]))
        _reduce_scatter(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        out = grad.new_empty((dist.get_world_size() * grad.shape[0], *grad.shape[1:]))
        _all_gather(out, grad.contiguous())
        return out


# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _flat(groups: list[list[str]]) -> list[str]:
    return [name for group in groups for name in group]


def _named(state: dict, names: list[str]) -> dict:
    """An optimizer state dict in torch's numbering (parameters numbered in group order) -> keyed by
    parameter name, given the names in that order (the layout of torch.distributed.checkpoint)."""
    return {"state": {names[i]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}


def _numbered(state: dict) -> dict:
    """The inverse of `_named`: parameters numbered in the order the groups list them."""
    index = {name: i for i, name in enumerate(_flat([g["params"] for g in state["param_groups"]]))}
    return {"state": {index[n]: s for n, s in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]}


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
