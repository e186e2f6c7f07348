"""Muon on the hidden matrices, AdamW on everything else, as one torch optimizer (Moonlight's split).

Kimi's models train with Muon (Moonlight, "Muon is Scalable for LLM Training", Liu et al. 2025; Kimi K2's
MuonClip). A hidden weight matrix W [A, B] moves along its orthogonalised momentum:

    M_t = mu M_{t-1} + (1 - mu) G_t                     momentum (torch's lerp form)
    N_t = (1 - mu) G_t + mu M_t                          Nesterov
    O_t = NS5(N_t) ~ U V^T          (N_t = U S V^T)     five quintic Newton-Schulz steps
    W_t = (1 - lr wd) W_{t-1} - lr 0.2 sqrt(max(A, B)) O_t

The factor 0.2 sqrt(max(A, B)) (Moonlight's "match the RMS of AdamW", torch's `adjust_lr_fn=
"match_rms_adamw"`) makes the update about as large as an AdamW update, so one learning rate and one
schedule serve both halves. The embedding table and the LM head, norm weights, biases, the gates' decay
parameters, the AttnRes queries and the short-convolution kernels take AdamW (torch's functional
`adamw`, with its state named as torch.optim.AdamW names it).

Newton-Schulz runs batched: the matrices of one shape (the MoE layers' experts, say) in stacks of bmm
calls of at most STACK_VALUES values each (so its workspace is bounded, whatever the model), in bfloat16
on GPUs (as Keller Jordan's reference does), in float32 on CPUs. Sharded matrices (FSDP's DTensors, rows
split over a group of ranks) are orthogonalised once each, by one owner rank that all-to-alls gather them
to and return the update from (`k3.training.dist_muon`; `owners=False`: every rank gathers every matrix
whole and runs them all, as before). QK-Clip
(MuonClip's guard on attention logits at scale) runs after the step, outside the optimizer:
k3.training.qk_clip. How it compares with AdamW on k3's runs: docs/training.md.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch.optim.adamw import adamw

from .dist_muon import group_key, ns_flops, orthogonalised_shards, sharded_group

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # quintic Newton-Schulz (Keller Jordan's, also torch.optim.Muon's)


def newton_schulz(G: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """G [A, B] or a stack [N, A, B] -> about U V^T for each matrix (G = U S V^T): the quintic iteration
    X <- a X + (b X X^T + c (X X^T)^2) X from X = G / ||G||_F, which drives every singular value
    towards 1 (to within about [0.7, 1.2] after five steps: not exactly, by design, and enough)."""
    a, b, c = NS_COEFFICIENTS
    X = G.to(_iteration_dtype(G))
    wide = X.shape[-2] <= X.shape[-1]
    X = X if wide else X.mT  # iterate on the side with the smaller Gram matrix
    X = X / torch.linalg.matrix_norm(X, keepdim=True).clamp(min=eps)
    batched = X.dim() == 3
    X = X if batched else X.unsqueeze(0)
    for _ in range(steps):
        gram = X @ X.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        X = torch.baddbmm(X, poly, X, beta=a)
    X = X if batched else X.squeeze(0)
    return (X if wide else X.mT).to(G.dtype)


def _iteration_dtype(G: torch.Tensor) -> torch.dtype:
    """bfloat16 on CUDA, as Keller Jordan's reference iterates; float32 on CPUs (AMX-BF16 measured only
    ~1.3x faster here at k3-tiny's shapes, and slower for small stacks); float64 stays float64."""
    if G.dtype == torch.float64:
        return torch.float64
    return torch.bfloat16 if G.device.type == "cuda" else torch.float32


def muon_scale(shape: torch.Size) -> float:
    """0.2 sqrt(max(A, B)): an orthogonal update of W [A, B] scaled to AdamW's update RMS (Moonlight)."""
    return 0.2 * math.sqrt(max(shape[0], shape[1]))


def takes_muon(name: str, param: torch.Tensor) -> bool:
    """Whether a parameter is a hidden matrix (Muon's): two dimensions, both > 1, and not the
    embedding table or the LM head (their rows are looked up or compared one token at a time)."""
    return param.dim() == 2 and min(param.shape) > 1 and "embed" not in name and not name.startswith("lm_head")


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The whole matrix: a sharded one (FSDP's DTensor) gathered from its ranks, a plain one as it is.
    Orthogonalisation is a property of the whole matrix, not of a shard's rows."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _like(update: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`update` (whole, the same on every rank) laid out as `param` is: this rank's shard of a DTensor."""
    if not hasattr(param, "device_mesh"):
        return update
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(update, param.device_mesh, param.placements, src_data_rank=None)


STACK_VALUES = 2**25  # values in one Newton-Schulz stack (128 MiB in float32): its workspace is a few of them


def _stacks(items: list, shape: torch.Size) -> list[list]:
    """`items` (one per matrix of `shape`) in runs of at most STACK_VALUES values (at least one matrix
    each): the matrices orthogonalised together. The iteration's temporaries (the stack, the Gram
    matrices, the next iterate) stay a few stacks' worth, not a few copies of every matrix of one shape
    (all the experts of all the MoE layers)."""
    per_stack = max(1, STACK_VALUES // math.prod(shape))
    return [items[i : i + per_stack] for i in range(0, len(items), per_stack)]


class Muon(torch.optim.Optimizer):
    """Muon for the groups marked `use_muon`, AdamW for the others (one optimizer, one state dict).

    Every group takes lr, weight_decay, betas (AdamW's), eps (AdamW's), momentum (Muon's) and ns_steps;
    the training loop sets one lr on all groups. A group is AdamW's unless it says `use_muon`:
    `k3.training.optim.muon_groups(model, weight_decay)` splits a k3 model (what `k3 train` uses), or

        Muon([{"params": hidden_matrices, "use_muon": True}, {"params": everything_else}], lr=3e-3)
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        betas=(0.9, 0.95),
        eps: float = 1e-8,
        momentum: float = 0.95,
        ns_steps: int = 5,
        fused: bool | None = None,
        owners: bool = True,
    ):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon: `momentum` must be in [0, 1), got {momentum!r}")
        if not (isinstance(ns_steps, int) and ns_steps >= 1):
            raise ValueError(f"Muon: `ns_steps` must be an integer >= 1, got {ns_steps!r}")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            betas=tuple(betas),
            eps=eps,
            momentum=momentum,
            ns_steps=ns_steps,
            use_muon=False,
            fused=fused,
        )
        super().__init__(params, defaults)
        self.owners = owners
        self.ns_flops = 0  # Newton-Schulz FLOPs this rank ran in the last step
        for group in self.param_groups:
            if group["use_muon"]:
                bad = [tuple(p.shape) for p in group["params"] if p.dim() != 2]
                if bad:
                    raise ValueError(f"Muon: a `use_muon` group holds only matrices (2-D), got shapes {bad}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.ns_flops = 0
        for group in self.param_groups:
            (self._muon_step if group["use_muon"] else self._adamw_step)(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        grads = [p.grad for p in params]
        for p in params:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        buffers = [self.state[p]["momentum_buffer"] for p in params]
        mu, lr = group["momentum"], group["lr"]
        torch._foreach_lerp_(buffers, grads, 1.0 - mu)
        if group["weight_decay"]:
            torch._foreach_mul_(params, 1.0 - lr * group["weight_decay"])
        by_shape, by_group = defaultdict(list), defaultdict(list)
        for p, g, m in zip(params, grads, buffers):
            shards = sharded_group(p) if self.owners else None
            if shards is None:
                by_shape[p.shape].append((p, g, m))
            else:
                by_group[group_key(shards)].append((shards, p, g, m))
        for shape, triples in by_shape.items():
            for part in _stacks(triples, shape):
                ps, gs, ms = zip(*part)
                nesterov = torch._foreach_lerp(list(gs), list(ms), mu)
                updates = newton_schulz(torch.stack([_whole(n) for n in nesterov]), group["ns_steps"]).unbind(0)
                updates = [_like(u, p) for u, p in zip(updates, ps)]
                torch._foreach_add_(list(ps), updates, alpha=-lr * muon_scale(shape))
                self.ns_flops += len(part) * ns_flops(shape, group["ns_steps"])
        for items in by_group.values():  # sharded: one owner per matrix (k3.training.dist_muon)
            shards, ps, gs, ms = items[0][0], *map(list, list(zip(*items))[1:])
            nesterov = list(torch._foreach_lerp(gs, ms, mu))  # (emptied by the exchange once sent)
            updates, flops = orthogonalised_shards(ps, nesterov, shards, group["ns_steps"], newton_schulz, _stacks)
            self.ns_flops += flops
            for p, u in zip(ps, updates):
                p.to_local().add_(u, alpha=-lr * muon_scale(p.shape))

    def _adamw_step(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adamw(
            params,
            [p.grad for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            [s["step"] for s in states],
            fused=group["fused"],
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
