"""Expert parallelism applied from outside (torchtitan's expert_parallel): every MoE layer's routed
experts split over the ranks of a group, the tokens sent to the ranks that hold their chosen experts
and back by all-to-all, as forward hooks on the layer's `RoutedExperts` that the model does not know
about (backward runs them in reverse).

In each MoE layer a token is sent once to each rank of its group that owns one of its chosen experts
and nowhere else (an all-to-all with per-rank counts, the dispatch of DeepSeek-V3, torchtitan and
Megatron), that rank returns the token's weighted sum over its own chosen experts, and a second
all-to-all brings those rows home, where they are summed. A token travels to at most min(k, R) - 1
other ranks (R ranks, top-k), so the traffic per rank is bounded by k whatever R; an all-gather of
every token grows with R.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ...layers.norm import upcast
from ...models import CausalLM
from ...ops.common import cast


def held_expert_parameters(model: CausalLM) -> list[nn.Parameter]:
    """The routed experts' parameters this process holds (under ep, its own slice of the experts)."""
    return [
        p for moe in model.moe_layers() for expert in moe.experts if expert is not None for p in expert.parameters()
    ]


def shard_experts(model: CausalLM, rank: int, world_size: int, group=None) -> None:
    """Keep this rank's slice of every MoE layer's routed experts (the others become None) and hook the
    token exchange around them (on a model on the meta device too: then nothing is allocated). `rank`
    and `world_size` are within `group`, the process group the tokens are exchanged in (None: all)."""
    for moe in model.moe_layers():
        moe.experts.ep_group = group
        per_rank = len(moe.experts) // world_size
        own = range(rank * per_rank, (rank + 1) * per_rank)
        for e in range(len(moe.experts)):
            if e not in own:
                moe.experts[e] = None
        moe.experts.register_forward_pre_hook(_dispatch_tokens)
        moe.experts.register_forward_hook(_combine_outputs)


@dataclass
class _Route:
    """What `_combine_outputs` needs of the dispatch: which token each sent row was, and the counts."""

    tokens: torch.Tensor  # [S] the token of each row sent, grouped by destination rank
    num_tokens: int  # N
    sent: list[int]  # rows sent to each rank
    received: list[int]  # rows received from each rank


def _dispatch_tokens(experts: nn.Module, args: tuple) -> tuple:
    """Before the routed experts: each token goes once to every rank that owns at least one of its k
    chosen experts (an all-to-all with per-rank counts), with its chosen experts and routing weights.
    There the experts run as in one process, skipping the experts held elsewhere (None), and return
    each received token's weighted sum over that rank's experts."""
    z, chosen, weights = args
    group = experts.ep_group
    world = dist.get_world_size(group)
    owner = chosen // (len(experts) // world)  # [N, k] the rank holding each chosen expert
    needs = torch.zeros(world, len(z), dtype=torch.bool, device=z.device)
    needs[owner.T, torch.arange(len(z), device=z.device).expand_as(owner.T)] = True  # [rank, token]
    destination, tokens = needs.nonzero(as_tuple=True)  # grouped by rank
    sent_counts = torch.bincount(destination, minlength=world)
    received_counts = torch.empty_like(sent_counts)
    dist.all_to_all_single(received_counts, sent_counts, group=group)
    sent, received = sent_counts.tolist(), received_counts.tolist()
    rows = _AllToAllRows.apply(z[tokens], sent, received, group)
    row_weights = _AllToAllRows.apply(weights[tokens], sent, received, group)
    row_chosen = chosen.new_empty((sum(received), chosen.shape[1]))
    dist.all_to_all_single(row_chosen, chosen[tokens].contiguous(), received, sent, group=group)
    experts._route = _Route(tokens, len(z), sent, received)
    return rows, row_chosen, row_weights


def _combine_outputs(experts: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    """After them: each row goes back to its token's rank (the reverse all-to-all), where a token's
    rows (one per rank it visited) are summed in float32, as one process sums its k experts."""
    route: _Route = experts.__dict__.pop("_route")
    y = _AllToAllRows.apply(out, route.received, route.sent, experts.ep_group)
    combined = torch.zeros(route.num_tokens, out.shape[-1], dtype=upcast(out).dtype, device=out.device)
    return cast(combined.index_add_(0, route.tokens, upcast(y)), out.dtype)


class _AllToAllRows(torch.autograd.Function):
    """Rows [sum(sent), ...] -> [sum(received), ...]: the first sent[0] rows go to rank 0, the next
    sent[1] to rank 1, ...; what arrives is stacked in rank order. Backward: the same exchange reversed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sent: list[int], received: list[int], group=None) -> torch.Tensor:
        ctx.sent, ctx.received, ctx.group = sent, received, group
        out = x.new_empty((sum(received), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), received, sent, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((sum(ctx.sent), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.sent, ctx.received, group=ctx.group)
        return out, None, None, None
