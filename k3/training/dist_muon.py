"""Distributed Muon: each sharded matrix orthogonalised once, by one owner rank, instead of on every rank.

Under FSDP a hidden matrix W [A, B] lives as row shards, rank i holding rows_i of it (DTensor's Shard(0):
torch.chunk's split). Newton-Schulz needs the whole matrix, and gathering it on every rank repeats the
same iteration world times and moves (world - 1) / world of every matrix to every rank. Here, per
process group (the dense matrices' FSDP group; each ep rank's experts' efsdp group):

    owner(W)       = a rank of the group, chosen to balance the matrices' sizes (greedy, largest first;
                     Newton-Schulz costs steps (4 s^2 l + 2 s^3) FLOPs, s = min(A, B), l = max(A, B))
    all-to-all     : rank i sends its rows_i of each Nesterov momentum N to N's owner
    owner          : O = NS5(N) on the matrices it owns (stacked by shape, as one-process Muon does)
    all-to-all     : the owner sends rows_i of O back to rank i, which updates its shard

A rank sends its shard of every matrix owned by another, and each owner the other ranks' rows of its
updates: about 2 (M - 1) / M^2 of the matrices' bytes per rank over M ranks, 2 / M of the whole-matrix
all-gather's (M - 1) / M; the Newton-Schulz FLOPs per rank fall to about 1 / M (microsoft/dion's FSDP2
Muon; torchtitan's DistMuon `Owned` layout; Moonshot's "Muon is Scalable" gathers whole matrices
instead). The update each rank applies is the one-process update of its rows: same maths, same order.
`exchange_plan` gives the split sizes; `exchange_bytes_per_rank` counts them for `k3 plan`
(`k3.plan.traffic`) and `k3 bench parallel` measures them.
"""

from __future__ import annotations

import collections
import contextvars
import functools
import heapq
import math
from dataclasses import dataclass

import torch

# True while a rank is inside distributed Muon's exchanges (`k3 bench parallel` counts their bytes apart)
EXCHANGING: contextvars.ContextVar[bool] = contextvars.ContextVar("k3_muon_exchanging", default=False)


def ns_flops(shape, steps: int = 5) -> int:
    """FLOPs of `steps` quintic Newton-Schulz iterations on a matrix of `shape` [A, B]: per iteration the
    Gram matrix (2 s^2 l), its square (2 s^3) and the product with X (2 s^2 l), s = min(A, B), l = max."""
    s, big = sorted(shape[-2:])
    return steps * (4 * s * s * big + 2 * s**3)


def row_split(rows: int, ranks: int) -> list[int]:
    """The rows each of `ranks` holds of a `rows`-row matrix sharded on dim 0 (torch.chunk's split, as
    DTensor's Shard(0) and FSDP2 lay it out: ceil(rows / ranks) each, the last ones short or empty)."""
    per = -(-rows // ranks) if rows else 0
    return [max(0, min(per, rows - i * per)) for i in range(ranks)]


def owners(shapes: list, ranks: int, steps: int = 5) -> list[int]:
    """The owner of each matrix of `shapes` among `ranks`, balanced by size (what an owner receives and
    sends back grows with it): largest first, each to the rank with the fewest values so far (ties: the
    fewer Newton-Schulz FLOPs, then the lowest rank). Equal sizes go by shape, so the same shapes in any
    order get the same loads. Every rank computes the same list."""
    return list(_owners(tuple(tuple(s) for s in shapes), ranks, steps))


@functools.lru_cache(maxsize=64)
def _owners(shapes: tuple, ranks: int, steps: int) -> tuple[int, ...]:
    heap = [(0, 0, r) for r in range(ranks)]  # (values, NS FLOPs, rank): the least loaded on top
    owner = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-math.prod(shapes[i]), shapes[i], i)):
        values, flops, rank = heapq.heappop(heap)
        owner[i] = rank
        heapq.heappush(heap, (values + math.prod(shapes[i]), flops + ns_flops(shapes[i], steps), rank))
    return tuple(owner)


@dataclass
class ExchangePlan:
    """The split sizes (in values) of a group's two all-to-alls, seen from rank `rank` of `ranks`."""

    shapes: list  # each matrix's global [A, B]
    owner: list[int]
    ranks: int
    rank: int

    def rows(self, i: int) -> list[int]:
        return row_split(self.shapes[i][0], self.ranks)

    def owned(self) -> list[int]:
        return [i for i, o in enumerate(self.owner) if o == self.rank]

    def to_owners(self) -> tuple[list[int], list[int]]:
        """(send, receive) values per rank for the momenta's way to their owners."""
        send = [0] * self.ranks
        for i, (A, B) in enumerate(self.shapes):
            send[self.owner[i]] += self.rows(i)[self.rank] * B
        receive = [0] * self.ranks
        for i in self.owned():
            for r, n in enumerate(self.rows(i)):
                receive[r] += n * self.shapes[i][1]
        return send, receive


def exchange_plan(shapes: list, ranks: int, rank: int, steps: int = 5) -> ExchangePlan:
    return ExchangePlan([tuple(s) for s in shapes], owners(shapes, ranks, steps), ranks, rank)


def exchange_bytes_per_rank(shapes: list, ranks: int, element_bytes: int = 4, steps: int = 5) -> list[int]:
    """The bytes each rank of `ranks` sends in one step's two exchanges of matrices `shapes`: its rows of
    each matrix another rank owns, and, as an owner, the other ranks' rows of its updates."""
    if ranks == 1:
        return [0]
    sent = [0] * ranks
    owned = collections.Counter(zip(map(tuple, shapes), owners(shapes, ranks, steps)))
    for (A, B), count in collections.Counter(map(tuple, shapes)).items():
        rows = row_split(A, ranks)
        for r in range(ranks):  # every rank sends its rows of each such matrix to the owner ...
            sent[r] += count * rows[r] * B
    for ((A, B), owner), count in owned.items():  # ... but the owner, who sends the others' rows back
        sent[owner] += count * (A - 2 * row_split(A, ranks)[owner]) * B
    return [n * element_bytes for n in sent]


def muon_exchange_bytes(shapes: list, ranks: int, element_bytes: int = 4, steps: int = 5) -> int:
    """The most bytes any rank of `ranks` sends in one step's two exchanges of matrices `shapes`."""
    return max(exchange_bytes_per_rank(shapes, ranks, element_bytes, steps))


def orthogonalised_shards(params: list, nesterov: list[torch.Tensor], group, steps: int, newton_schulz, stacks):
    """The local rows of NS5(N) for each sharded matrix of `params` (DTensors sharded on dim 0 over
    `group`), given their Nesterov momenta's local shards `nesterov` (a list this call may free): the two
    all-to-alls of the module, Newton-Schulz on the owner (by shape, in `stacks` of bounded size).
    Returns (updates, NS FLOPs run here). At most two buffers of the rank's matrix values live at once
    (send and received, received and updates, updates and back, back and returned)."""
    import torch.distributed as dist

    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    shapes = [tuple(p.shape) for p in params]
    plan = exchange_plan(shapes, ranks, rank, steps)
    local = [n.to_local() if hasattr(n, "to_local") else n for n in nesterov]
    local_shapes, dtype, device = [t.shape for t in local], local[0].dtype, local[0].device
    send_sizes, receive_sizes = plan.to_owners()
    by_owner = [[i for i in range(len(params)) if plan.owner[i] == r] for r in range(ranks)]
    send = torch.cat([local[i].reshape(-1) for r in range(ranks) for i in by_owner[r]] or [local[0].new_empty(0)])
    nesterov.clear()
    del local
    received = _all_to_all(send, receive_sizes, send_sizes, group)
    del send
    # rank r's piece holds its rows of each matrix I own, in order: each matrix is put together in its stack
    pieces = list(received.split(receive_sizes))
    owned = plan.owned()
    rows_of = {i: plan.rows(i) for i in owned}
    parts = {i: [] for i in owned}
    for r in range(ranks):
        offset = 0
        for i in owned:
            n = rows_of[i][r] * shapes[i][1]
            parts[i].append(pieces[r][offset : offset + n].view(rows_of[i][r], shapes[i][1]))
            offset += n
    updates, flops, by_shape = {}, 0, {}
    for i in owned:
        by_shape.setdefault(shapes[i], []).append(i)
    for shape, items in by_shape.items():
        for part in stacks(items, torch.Size(shape)):
            out = newton_schulz(torch.stack([torch.cat(parts[i]) for i in part]), steps).unbind(0)
            updates.update(zip(part, out))
            flops += len(part) * ns_flops(shape, steps)
    del received, pieces, parts
    # back: rank r's rows of each update I own, to r
    back = [updates[i][sum(rows_of[i][:r]) : sum(rows_of[i][: r + 1])].reshape(-1) for r in range(ranks) for i in owned]
    back = torch.cat(back).to(dtype) if back else torch.empty(0, dtype=dtype, device=device)
    del updates
    returned = _all_to_all(back, send_sizes, receive_sizes, group)
    del back
    mine, pieces = [None] * len(params), list(returned.split(send_sizes))
    for r in range(ranks):
        offset = 0
        for i in by_owner[r]:
            n = local_shapes[i].numel()
            mine[i] = pieces[r][offset : offset + n].view(local_shapes[i])
            offset += n
    return mine, flops


def _all_to_all(send: torch.Tensor, receive_sizes: list[int], send_sizes: list[int], group) -> torch.Tensor:
    import torch.distributed as dist

    received = send.new_empty(sum(receive_sizes))
    token = EXCHANGING.set(True)
    try:
        dist.all_to_all_single(received, send, receive_sizes, send_sizes, group=group)
    finally:
        EXCHANGING.reset(token)
    return received


def sharded_group(param) -> object | None:
    """The process group over which `param`'s rows are split when it is a DTensor sharded on dim 0 over a
    one-dimensional mesh (FSDP2's layout under `--parallel fsdp`), else None (a plain tensor; another
    layout gathers whole, as before)."""
    if not hasattr(param, "device_mesh"):
        return None
    from torch.distributed.tensor import Shard

    mesh, placements = param.device_mesh, param.placements
    if mesh.ndim != 1 or len(placements) != 1 or placements[0] != Shard(0) or mesh.size() == 1:
        return None
    return mesh.get_group()


def group_key(group) -> str:
    import torch.distributed as dist

    return dist.get_process_group_ranks(group).__repr__()


__all__ = [
    "EXCHANGING",
    "exchange_bytes_per_rank",
    "exchange_plan",
    "muon_exchange_bytes",
    "ns_flops",
    "orthogonalised_shards",
    "owners",
    "row_split",
    "sharded_group",
]
