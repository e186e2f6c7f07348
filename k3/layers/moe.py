"""Mixture of experts: Kimi Linear's (SwiGLU experts at full width) and Kimi K3's latent MoE.

Routing (DeepSeek-V3 style, aux-loss-free):

    s        = sigmoid(x W_router^T)                         in float32, [N, E]
    chosen   = top-k of (s + e_score_correction_bias)        the bias steers selection only
    w_i      = s_i / (sum_{j in chosen} s_j + 1e-20) * routed_scaling_factor      for i in chosen

(renormalised only when `renormalize` and k > 1, as Kimi K3's code does: otherwise w_i = s_i times the
factor)

Routed path: Kimi Linear runs the experts on x; K3 first projects to a latent space,
z = latent_down_proj(x) [d -> d_latent], sums w_i expert_i(z), normalises (RMSNorm over d_latent) and
projects back with latent_up_proj. Shared experts (one gated MLP of width n_shared * expert width) run
on the original x (the article calls them latent too; the public config has them at full width).
Output = routed + shared.

Balancing: after each training step, `update_bias(load)` moves each expert's correction bias by
+rate if it received fewer tokens than the mean and by -rate if more (the bias never enters w).
The router's checkpoint name is `gate` (`block_sparse_moe.gate.weight`, as in Kimi Linear and DeepSeek);
in code it is `MoE.router`, a `Router`: "gate" in k3 means the KDA forget gate and the output gates.

Dispatch (`RoutedExperts`) costs what the k chosen experts cost, not all E, with nothing read back to the host
(the forward compiles whole): the assignments grouped by expert and run as a grouped GEMM, or, where torch's
does not run (float64) and for a few tokens, as slots of batched matmuls whose number the shapes set (one slot
per assignment when decoding: each token's experts gathered, gpt-fast's Mixtral). A decode step
(k3.inference.decode_step) passes the experts stacked once (`fused`, from `MoE.fuse_for_decoding`). It
is a module of its own so that expert parallelism (k3.training.parallel) plugs in from outside: a process keeps
a slice of the experts, and hooks on this module gather the tokens before it and sum the slices' outputs after it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.common import cast
from . import init
from .ffn import GatedMLP, situ
from .grouped_mm import TORCH_DTYPES, grouped_mm
from .init import init_linear
from .joined import join, project
from .norm import RMSNorm, upcast

STACKED_BYTES_LIMIT = 1 << 30  # the largest routed experts kept a second time as stacked matrices (inference)
SLOT_ROWS = 64  # rows of compute that one slot's gather of its expert's matrices costs about (RoutedExperts)


class DecodeWeights(NamedTuple):
    """A MoE layer's copies for the decode step (`MoE.fuse_for_decoding`)."""

    inputs: torch.Tensor | None  # the input projections joined (None: fewer than two)
    experts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (W1, W3, W2) stacked; None: cannot be


class Expert(nn.Module):
    """One routed expert, w2(act(w1 x) * w3 x) (checkpoint names w1 = gate, w3 = up, w2 = down).

    The three matrices are plain parameters ([hidden, dim], [dim, hidden], [hidden, dim]), not
    nn.Linear submodules: Kimi K3 has 82,432 experts and a module per matrix would make building it
    on the meta device take minutes. Checkpoints' `experts.N.w1.weight` map to `experts.N.w1`."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        activation: str = "swiglu",
        situ_beta: float = 4.0,
        situ_linear_beta: float | None = 25.0,
    ):
        super().__init__()
        self.activation, self.situ_beta, self.situ_linear_beta = activation, situ_beta, situ_linear_beta
        self.w1 = nn.Parameter(torch.empty(hidden, dim))
        self.w3 = nn.Parameter(torch.empty(hidden, dim))
        self.w2 = nn.Parameter(torch.empty(dim, hidden))
        self.reset_parameters()

    def reset_parameters(self, std: float | None = None, residual_std: float | None = None) -> None:
        """See k3.layers.init: w1, w3 ~ N(0, std), the output w2 ~ N(0, residual_std). Skipped on the
        meta device, where Kimi K3's 82,432 experts are built only to be counted."""
        if self.w1.is_meta:
            return
        if std is None:  # nn.Linear's default for each matrix
            for w in (self.w1, self.w3, self.w2):
                init.uniform_(w, -(w.shape[1] ** -0.5), w.shape[1] ** -0.5)
            return
        init.normal_(self.w1, std)
        init.normal_(self.w3, std)
        init.normal_(self.w2, std if residual_std is None else residual_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> w2 act(w1 x, w3 x) [..., dim]."""
        return F.linear(self.act(F.linear(x, self.w1), F.linear(x, self.w3)), self.w2)

    def act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The gated activation of gate = w1 x and up = w3 x (same shape): SiTU-GLU or SwiGLU."""
        if self.activation == "situ":
            return situ(gate, up, self.situ_beta, self.situ_linear_beta)
        return F.silu(gate) * up


class Router(nn.Module):
    """Sigmoid router with the aux-loss-free correction bias (`weight` [E, d], `e_score_correction_bias` [E])."""

    def __init__(
        self, dim: int, num_experts: int, top_k: int, routed_scaling_factor: float = 1.0, renormalize: bool = True
    ):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"Router: `top_k` must be in [1, num_experts = {num_experts}], got {top_k}")
        self.top_k, self.routed_scaling_factor, self.renormalize = top_k, routed_scaling_factor, renormalize
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))
        self.reset_parameters()

    def reset_parameters(self, std: float | None = None) -> None:
        """Router weight ~ N(0, std) (None: std = dim^-1/2); the correction bias starts at zero (it is
        state, not a parameter)."""
        init.normal_(self.weight, self.weight.shape[1] ** -0.5 if std is None else std)
        nn.init.zeros_(self.e_score_correction_bias)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, d] -> the sigmoid affinity of every token for every expert, [N, E] in float32."""
        return torch.sigmoid(F.linear(upcast(x), upcast(self.weight)))

    def choose(self, scores: torch.Tensor, balanced: bool = True) -> torch.Tensor:
        """The top-k experts [N, k] by `scores` [N, E] plus the correction bias (balanced=False: by the
        bare scores, which the bias exists to correct)."""
        if balanced:
            scores = scores + cast(self.e_score_correction_bias, scores.dtype)
        return scores.topk(self.top_k, dim=-1).indices

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, d] -> (expert indices [N, k], weights [N, k] in float32)."""
        scores = self.scores(x)  # [N, E]
        chosen = self.choose(scores)
        weights = scores.gather(-1, chosen)
        if self.renormalize and self.top_k > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * self.routed_scaling_factor
        return chosen, weights


class RoutedExperts(nn.ModuleList):
    """The routed experts (`experts.N`), called as one module: sum_i w_i expert_i(z) over each token's
    k chosen experts, for training, prefill and decoding alike, with nothing read back to the host (every
    index is computed on the device and every shape is set by the inputs' shapes), so the forward compiles
    whole and a GPU stream never waits:

        H_j = act(x_{t_j} W1_{e_j}^T, x_{t_j} W3_{e_j}^T);   Y_j = H_j W2_{e_j}^T;   out_n = sum_{j of n} w_j Y_j

    over the N k assignments j (token t_j, expert e_j), grouped by expert, as a grouped GEMM
    (`k3::grouped_mm`: torch's `grouped_mm`, one matmul over every expert's rows, their offsets on the
    device, as an op torch.compile keeps whole).
    Where it does not run (float64, the exactness tests' dtype; rows not 16-byte aligned) and for a few
    tokens (decoding: most experts would get no row), the same groups run as slots of `capacity` rows
    (`slot_capacity`, set by the shapes) in three batched matmuls, each slot against its expert's matrices
    gathered by index: expert e fills ceil(count_e / capacity) slots, zeros pad its last, and since
    sum_e ceil(count_e / c) <= (N k + E (c - 1)) / c that many slots always run. With capacity 1 each
    assignment is its own slot, in token order: each token's experts gathered (gpt-fast's Mixtral).

    Rows move by one flat index (the token each row holds; N, a zero row, for padding): a gather in, a
    scatter-add out, whose backwards are a scatter-add and a gather. An entry may be None: under expert
    parallelism a process holds only its own slice of the experts; its assignments to the others run
    against zero matrices (their processes compute them)."""

    def forward(
        self,
        z: torch.Tensor,
        chosen: torch.Tensor,
        weights: torch.Tensor,
        stack: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """z [N, d], chosen [N, k] expert indices, weights [N, k] -> [N, d]. `stack`: the held experts'
        (W1, W3, W2) stacked once (`stack_for_decoding`, a decode step's copy), a keyword (expert
        parallelism's hooks see the three tensors before it); without it they are stacked here."""
        held = [i for i, e in enumerate(self) if e is not None]
        if stack is None:
            stack = tuple(torch.stack([getattr(self[i], name) for i in held]) for name in ("w1", "w3", "w2"))
        expert = chosen.flatten()
        if len(held) < len(self):  # experts held elsewhere: one more, of zero matrices, takes their rows
            local = torch.full((len(self),), len(held), dtype=torch.long)
            local[held] = torch.arange(len(held))
            expert = local.to(expert.device)[expert]
            stack = tuple(torch.cat([w, w.new_zeros(1, *w.shape[1:])]) for w in stack)
        act = self[held[0]].act
        capacity = slot_capacity(expert.numel(), stack[0].shape[0])
        if capacity == 1:
            return cast(_gathered(z, expert, weights, stack, act), z.dtype)
        if grouped_mm_runs(z, stack):
            y, token = _grouped(z, expert, weights.flatten(), stack, act, chosen.shape[1])
        else:
            y, token = _slots(z, expert, weights.flatten(), stack, act, chosen.shape[1], capacity)
        out = y.new_zeros(z.shape[0] + 1, z.shape[-1]).index_add_(0, token, y)
        return cast(out[:-1], z.dtype)

    @torch.no_grad()
    def stack_for_decoding(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The held experts' matrices stacked, (W1 [E, hidden, d], W3 [E, hidden, d], W2 [E, d, hidden]) (a
        copy, made by `CausalLM.decoding_weights`, passed back as `stack` when decoding, so a token does not
        stack them again). None past STACKED_BYTES_LIMIT bytes, and for experts that are not plain `Expert`s
        (MXFP4: kept packed, decoded as each forward stacks them)."""
        held = [e for e in self if e is not None]
        if (
            not all(type(e) is Expert for e in held)
            or sum(p.numel() * p.element_size() for e in held for p in (e.w1, e.w3, e.w2)) > STACKED_BYTES_LIMIT
        ):
            return None
        return tuple(torch.stack([getattr(e, name).detach() for e in held]) for name in ("w1", "w3", "w2"))


def slot_capacity(assignments: int, experts: int) -> int:
    """Rows per slot for `assignments` (N k) over `experts` held, from the shapes alone: the power of two
    C that costs least, counting the padding rows run, experts x (C - 1) at most, against the slots
    run, (assignments + experts (C - 1)) / C, each of which gathers its expert's three matrices and
    costs about SLOT_ROWS rows of compute. A few tokens (decoding) get C = 1: no padding at all."""
    best, best_cost, capacity = 1, None, 1
    while capacity <= max(1, assignments):
        cost = experts * (capacity - 1) + SLOT_ROWS * ((assignments + experts * (capacity - 1)) // capacity)
        if best_cost is None or cost < best_cost:
            best, best_cost = capacity, cost
        capacity *= 2
    return best


def grouped_mm_runs(z: torch.Tensor, stack) -> bool:
    """Whether torch's grouped GEMM takes these operands: a float32, bfloat16 or float16 input whose rows,
    and the matrices' rows, are a multiple of 16 bytes."""
    if not hasattr(F, "grouped_mm") or z.dtype not in TORCH_DTYPES:
        return False
    sizes = [z.shape[-1]] + [n for w in stack for n in w.shape[1:]]
    return all(w.dtype == z.dtype for w in stack) and all(n * z.element_size() % 16 == 0 for n in sizes)


def _grouped(z, expert, weights, stack, act, k):
    """The assignments sorted by expert, one grouped GEMM per matrix: (weighted rows [N k, d], their tokens)."""
    order = torch.argsort(expert, stable=True)
    counts = torch.zeros(stack[0].shape[0], dtype=torch.long, device=z.device).index_add_(
        0, expert, torch.ones_like(expert)
    )
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    token = order // k
    x = z.index_select(0, token)
    W1, W3, W2 = stack
    # torch's op and its own autograd in eager; under torch.compile (and in float64) k3's, whose shape
    # function takes every dtype
    if torch.compiler.is_compiling() or z.dtype not in TORCH_DTYPES:
        gmm = grouped_mm
    else:
        gmm = lambda a, b, offs: F.grouped_mm(a, b, offs=offs)  # noqa: E731
    h = act(gmm(x, W1.transpose(1, 2), offsets), gmm(x, W3.transpose(1, 2), offsets))
    y = gmm(h, W2.transpose(1, 2), offsets)
    return upcast(y) * weights.index_select(0, order).unsqueeze(-1), token


def _gathered(z, expert, weights, stack, act):
    """A few tokens (decoding; slots of one row): each assignment against its expert's matrices gathered by
    index (gpt-fast's Mixtral), the k outputs of each token weighted and summed: [N, d]."""
    (N, k), d = weights.shape, z.shape[-1]
    X = z.unsqueeze(1).expand(N, k, d).reshape(N * k, 1, d)  # sizes spelled out: N may be 0 (expert parallelism)
    W1, W3, W2 = (w.index_select(0, expert) for w in stack)
    H = act(torch.bmm(X, W1.transpose(1, 2)), torch.bmm(X, W3.transpose(1, 2)))  # [N k, 1, hidden]
    Y = torch.bmm(H, W2.transpose(1, 2)).view(N, k, d)
    return (upcast(Y) * weights.unsqueeze(-1)).sum(1)


def _slots(z, expert, weights, stack, act, k, capacity):
    """The assignments in slots of `capacity` > 1 rows (see `RoutedExperts`): (weighted rows, their tokens;
    a padding row's token is N, the zero row past the last)."""
    (N, d), A, E = z.shape, expert.numel(), stack[0].shape[0]
    device = z.device
    slots = (A + E * (capacity - 1)) // capacity
    counts = torch.zeros(E, dtype=torch.long, device=device).index_add_(0, expert, torch.ones_like(expert))
    per_expert = (counts + capacity - 1) // capacity  # slots each expert fills
    first_slot = torch.cumsum(per_expert, 0) - per_expert
    order = torch.argsort(expert, stable=True)  # assignments, grouped by expert
    expert_of = expert[order]
    place = torch.arange(A, device=device) - (torch.cumsum(counts, 0) - counts)[expert_of]  # among its expert's
    row = (first_slot[expert_of] + place // capacity) * capacity + place % capacity
    source = torch.full((slots * capacity,), N, dtype=torch.long, device=device).index_copy_(0, row, order // k)
    row_weight = weights.new_zeros(slots * capacity).index_copy_(0, row, weights.index_select(0, order))
    # the expert of each slot; the slots past the used ones (all padding) run the last expert on zeros
    used = torch.arange(slots, device=device)
    slot_expert = torch.searchsorted(torch.cumsum(per_expert, 0), used, right=True).clamp(max=E - 1)
    X = torch.cat([z, z.new_zeros(1, d)]).index_select(0, source).view(slots, capacity, d)
    W1, W3, W2 = (w.index_select(0, slot_expert) for w in stack)
    H = act(torch.bmm(X, W1.transpose(1, 2)), torch.bmm(X, W3.transpose(1, 2)))  # [slots, capacity, hidden]
    Y = torch.bmm(H, W2.transpose(1, 2)).view(slots * capacity, d)
    return upcast(Y) * row_weight.unsqueeze(-1), source


class MoE(nn.Module):
    """Routed experts (optionally in a latent space) plus shared experts. See the module docstring."""

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        expert_hidden: int,
        *,
        num_shared: int = 1,
        latent_dim: int | None = None,
        activation: str = "swiglu",
        situ_beta: float = 4.0,
        situ_linear_beta: float | None = 25.0,
        routed_scaling_factor: float = 1.0,
        renormalize: bool = True,
        norm_eps: float = 1e-6,
    ):
        super().__init__()
        expert_dim = dim if latent_dim is None else latent_dim
        self.gate = Router(dim, num_experts, top_k, routed_scaling_factor, renormalize)
        self.experts = RoutedExperts(
            Expert(expert_dim, expert_hidden, activation, situ_beta, situ_linear_beta) for _ in range(num_experts)
        )
        self.shared_experts = (
            GatedMLP(dim, num_shared * expert_hidden, activation, situ_beta, situ_linear_beta)
            if num_shared > 0
            else None
        )
        if latent_dim is not None:
            self.latent_down_proj = nn.Linear(dim, latent_dim, bias=False)
            self.latent_norm = RMSNorm(latent_dim, eps=norm_eps)
            self.latent_up_proj = nn.Linear(latent_dim, dim, bias=False)
        self.latent_dim = latent_dim
        self.last_load: torch.Tensor | None = None  # tokens routed to each expert by the last forward
        self.reset_parameters()

    @property
    def router(self) -> Router:
        """The router (stored as `gate`, the checkpoints' name)."""
        return self.gate

    def reset_parameters(self, std: float | None = None, residual_std: float | None = None) -> None:
        """See k3.layers.init: the router, experts, shared experts and latent projections; the latent
        up-projection and the experts' w2 write into the residual stream (residual_std)."""
        residual_std = std if residual_std is None else residual_std
        self.router.reset_parameters(std)
        for expert in self.experts:
            if expert is not None:  # None: held by another process (expert parallelism)
                expert.reset_parameters(std, residual_std)
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters(std, residual_std)
        if self.latent_dim is not None:
            init_linear(self.latent_down_proj, std)
            self.latent_norm.reset_parameters()
            init_linear(self.latent_up_proj, residual_std)

    def forward(self, x: torch.Tensor, fused: DecodeWeights | None = None) -> torch.Tensor:
        """x [..., dim] -> [..., dim], the tokens routed to each expert counted in `last_load`. `fused`: the
        decoding copies (`fuse_for_decoding`): the input projections as one matmul and the experts stacked
        once; without them each projection as it is and the experts stacked by the call."""
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        chosen, weights = self.router(h)
        projected = project(h, self._input_projections(), None if fused is None else fused.inputs)
        z = h if self.latent_dim is None else projected.pop(0)
        self.last_load = torch.zeros(len(self.experts), dtype=torch.long, device=chosen.device).index_add_(
            0, chosen.flatten(), torch.ones_like(chosen.flatten())
        )
        routed = self.experts(z, chosen, weights, stack=None if fused is None else fused.experts)
        if self.latent_dim is not None:
            routed = self.latent_up_proj(self.latent_norm(routed))
        if self.shared_experts is not None:
            routed = routed + self.shared_experts.from_projections(*projected)
        return routed.view(shape)

    def _input_projections(self) -> list[nn.Linear]:
        """The projections of the input, in the order `fuse_for_decoding` joins them: the latent
        down-projection, the shared expert's gate and up (those the layer has)."""
        latent = [self.latent_down_proj] if self.latent_dim is not None else []
        shared = [] if self.shared_experts is None else [self.shared_experts.gate_proj, self.shared_experts.up_proj]
        return latent + shared

    def fuse_for_decoding(self) -> DecodeWeights:
        """The copies a decode step passes to `forward` as `fused`: the input projections joined
        (`k3.layers.joined`) and the routed experts stacked (`RoutedExperts.stack_for_decoding`)."""
        return DecodeWeights(join(self._input_projections()), self.experts.stack_for_decoding())

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor | None = None, rate: float = 1e-3) -> None:
        """Aux-loss-free balancing: bias += rate * sign(mean load - load) (default: the last forward's load)."""
        load = self.last_load if load is None else load
        if load is None:
            raise ValueError("MoE.update_bias: no `load` given and no forward has run yet")
        load = load.float()
        self.router.e_score_correction_bias += rate * torch.sign(load.mean() - load)
