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

Dispatch (`RoutedExperts`) costs what the k chosen experts cost, not all E, two ways, chosen by an
explicit argument: training, prefill and eager decoding run every used expert at once as three batched
matmuls over the tokens grouped by expert, in slots of equal size (a busy expert takes several); a decode
step (k3.inference.decode_step) passes the experts' matrices stacked when it was made (`fused`, from
`MoE.fuse_for_decoding`), and each token's chosen ones are gathered from them by index (no host sync, no
data-dependent shape, so the step compiles to one graph, gpt-fast's Mixtral). It is a module of its own
so that expert parallelism (k3.training.parallel) plugs in from outside: a process keeps a slice of the
experts, and hooks on this module gather the tokens before it and sum the slices' outputs after it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.common import cast
from .ffn import GatedMLP, situ
from . import init
from .init import init_linear
from .joined import join, project
from .norm import RMSNorm, upcast

STACKED_BYTES_LIMIT = 1 << 30  # the largest routed experts kept a second time as stacked matrices (inference)


class DecodeWeights(NamedTuple):
    """A MoE layer's copies for the decode step (`MoE.fuse_for_decoding`)."""

    inputs: torch.Tensor | None  # the input projections joined (None: fewer than two)
    experts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (W1, W3, W2) stacked; None: cannot be


class Expert(nn.Module):
    """One routed expert, w2(act(w1 x) * w3 x) (checkpoint names w1 = gate, w3 = up, w2 = down).

    The three matrices are plain parameters ([hidden, dim], [dim, hidden], [hidden, dim]), not
    nn.Linear submodules: Kimi K3 has 82,432 experts and a module per matrix would make building it
    on the meta device take minutes. Checkpoints' `experts.N.w1.weight` map to `experts.N.w1`."""

    def __init__(self, dim: int, hidden: int, activation: str = "swiglu", situ_beta: float = 4.0,
                 situ_linear_beta: float | None = 25.0):
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
                init.uniform_(w, -w.shape[1] ** -0.5, w.shape[1] ** -0.5)
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

    def __init__(self, dim: int, num_experts: int, top_k: int, routed_scaling_factor: float = 1.0,
                 renormalize: bool = True):
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
    k chosen experts, two ways that agree to rounding, chosen by an explicit argument (`stack`):

    - without `stack` (training, prefill, eager decoding): the tokens grouped by expert in slots of equal
      size, every used expert at once as three batched matmuls (`_batched`);
    - with `stack` (the decode step's, `stack_for_decoding`): the chosen experts' matrices gathered from
      it by index (`_gathered`): no host sync, shapes set by the inputs alone, so the step compiles whole.

    An entry may be None: under expert parallelism a process holds only its own slice of the
    experts, and the tokens routed to the others are computed by the processes that own them."""

    def forward(self, z: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor | None,
                stack: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """z [N, d], chosen [N, k] expert indices, weights [N, k], counts [E] (tokens per expert, the
        bincount of `chosen`; None with `stack`) -> [N, d]. `stack`: every expert's (W1, W3, W2) stacked
        (`stack_for_decoding`), a keyword (expert parallelism's hooks see the four tensors before it)."""
        if stack is not None:
            return self._gathered(z, chosen, weights, stack)
        return self._batched(z, chosen, weights, counts)

    @torch.no_grad()
    def stack_for_decoding(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Every expert's matrices stacked, (W1 [E, hidden, d], W3 [E, hidden, d], W2 [E, d, hidden]) (a copy,
        made by `CausalLM.decoding_weights`, passed back as `stack` when decoding). Only plain experts held in
        this process, within STACKED_BYTES_LIMIT bytes, can be stacked: None for others (MXFP4, experts held by
        other processes), which decode in slots."""
        if not all(type(e) is Expert for e in self) or sum(
                p.numel() * p.element_size() for e in self for p in (e.w1, e.w3, e.w2)) > STACKED_BYTES_LIMIT:
            return None
        return tuple(torch.stack([getattr(e, name).detach() for e in self]) for name in ("w1", "w3", "w2"))

    def _gathered(self, z: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, stack) -> torch.Tensor:
        """`forward` in a decode step: the N*k chosen experts' matrices gathered from `stack` by index, in the
        order of `chosen` (token by token), W1, W3 [N*k, hidden, d] and W2 [N*k, d, hidden], then

            [gate_n1 ... gate_nk] = z_n [W1_{e_n1}; ...; W1_{e_nk}]^T      one matmul per token (and per W3 for up)
            y_ni = act(gate_ni, up_ni) W2_{e_ni}^T                          one matmul per (token, expert) pair
            out_n = sum_i w_ni y_ni                                         in float32, as `_batched`

        Row vectors times transposed matrices: the form batched matmul runs fastest for one row."""
        W1, W3, W2 = (w.index_select(0, chosen.flatten()) for w in stack)
        N, k = weights.shape
        d = z.shape[-1]
        x = z.unsqueeze(1)  # [N, 1, d]
        gate = torch.bmm(x, W1.reshape(N, -1, d).transpose(1, 2))  # [N, 1, k*hidden]
        up = torch.bmm(x, W3.reshape(N, -1, d).transpose(1, 2))
        hidden = self[0].act(gate, up).view(N * k, 1, -1)  # [N*k, 1, hidden]
        y = torch.bmm(hidden, W2.transpose(1, 2)).view(N, k, d)
        return cast((y * weights.unsqueeze(-1)).sum(1), z.dtype)

    def _batched(self, z: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor
                 ) -> torch.Tensor:
        """`forward` with every used expert at once, in slots of `capacity` rows: expert e's tokens fill
        ceil(count_e / capacity) slots (`_slots`; zeros pad each expert's last one: the activation of 0 is
        0, and the padded rows are never read back), slot i runs expert slots[i], and three batched matmuls
        run every slot against its expert's matrices:

            H_i = act(X_i W1_{e_i}^T, X_i W3_{e_i}^T);   Y_i = H_i W2_{e_i}^T;   out_n = sum_j w_nj Y[row_nj]

        A handful of ops whatever the number of experts; a busy expert takes several slots rather than
        every expert padding to its count, so an unbalanced routing costs few padded rows. Rows move by one
        flat index, `source` [slots * capacity] (the token each row holds; N, a zero row, for padding): a
        gather in, a scatter-add out, whose backwards are a scatter-add and a gather (advanced indexing's
        backward, an accumulating index_put, costs several times as much on CPU). Under expert parallelism
        the assignments to experts held elsewhere (None) are left to their processes."""
        (N, k), d = chosen.shape, z.shape[-1]
        device = chosen.device
        flat, flat_weights = chosen.flatten(), weights.flatten()
        token = torch.arange(N * k, device=device) // k  # the token of each assignment
        held = [e is not None for e in self]
        if not all(held):
            keep = torch.tensor(held, device=device)
            flat_held = keep[flat]
            flat, flat_weights, token = flat[flat_held], flat_weights[flat_held], token[flat_held]
            counts = counts * keep.to(counts.device)
        counts_list = counts.tolist()
        if not any(counts_list):
            return z.new_zeros(N, d)
        capacity, slots = _slots(counts_list)
        order = torch.argsort(flat, stable=True)  # assignments, grouped by expert
        expert_of = flat[order]
        counts = counts.to(device)
        per_expert = (counts + capacity - 1) // capacity  # slots of each expert
        first = torch.cumsum(counts, 0) - counts  # each expert's first assignment
        first_slot = torch.cumsum(per_expert, 0) - per_expert
        place = torch.arange(len(flat), device=device) - first[expert_of]  # the assignment's place among its expert's
        row = (first_slot[expert_of] + place // capacity) * capacity + place % capacity  # in [slots * capacity]
        S = len(slots)
        source = torch.full((S * capacity,), N, dtype=torch.long, device=device).index_copy_(0, row, token[order])
        X = torch.cat([z, z.new_zeros(1, d)]).index_select(0, source).view(S, capacity, d)
        # only the experts that got tokens: the others get no gradient
        used = sorted(set(slots))
        position = {e: i for i, e in enumerate(used)}
        slot_expert = torch.tensor([position[e] for e in slots], device=device)
        W1, W3, W2 = (torch.stack([getattr(self[e], name) for e in used]).index_select(0, slot_expert)
                      for name in ("w1", "w3", "w2"))
        act = self[used[0]].act
        H = act(torch.bmm(X, W1.transpose(1, 2)), torch.bmm(X, W3.transpose(1, 2)))  # [S, capacity, hidden]
        Y = torch.bmm(H, W2.transpose(1, 2)).view(S * capacity, d)
        row_weight = weights.new_zeros(S * capacity).index_copy(0, row, flat_weights.index_select(0, order))
        y = upcast(Y) * row_weight.unsqueeze(-1)  # padding rows: weight 0
        out = y.new_zeros(N + 1, d).index_add_(0, source, y)
        return cast(out[:N], z.dtype)


def _slots(counts: list[int]) -> tuple[int, list[int]]:
    """The slots `RoutedExperts._batched` runs for experts with `counts` tokens: (capacity, the expert of
    each slot). The capacity is the one of max(counts) / j, j = 1..4, that needs the fewest rows in all
    (the fewer slots on a tie): the busiest expert's count when the routing is balanced, a fraction of it
    when a few experts draw most tokens."""
    busiest = max(counts)
    best = None
    for j in range(1, 5):
        capacity = max(1, -(-busiest // j))
        slots = sum(-(-c // capacity) for c in counts)
        if best is None or capacity * slots < best[0] * best[1]:
            best = (capacity, slots)
    capacity = best[0]
    return capacity, [e for e, c in enumerate(counts) for _ in range(-(-c // capacity))]


class MoE(nn.Module):
    """Routed experts (optionally in a latent space) plus shared experts. See the module docstring."""

    def __init__(self, dim: int, num_experts: int, top_k: int, expert_hidden: int, *, num_shared: int = 1,
                 latent_dim: int | None = None, activation: str = "swiglu", situ_beta: float = 4.0,
                 situ_linear_beta: float | None = 25.0, routed_scaling_factor: float = 1.0, renormalize: bool = True,
                 norm_eps: float = 1e-6):
        super().__init__()
        expert_dim = dim if latent_dim is None else latent_dim
        self.gate = Router(dim, num_experts, top_k, routed_scaling_factor, renormalize)
        self.experts = RoutedExperts(Expert(expert_dim, expert_hidden, activation, situ_beta, situ_linear_beta)
                                     for _ in range(num_experts))
        self.shared_experts = (GatedMLP(dim, num_shared * expert_hidden, activation, situ_beta, situ_linear_beta)
                               if num_shared > 0 else None)
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
        """x [..., dim] -> [..., dim]. `fused`: the decode step's copies (`fuse_for_decoding`): the input
        projections as one matmul and the experts' gathered path; without them (training, prefill, eager
        decoding) each projection as it is, the experts in slots, and the load counted (`last_load`)."""
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        chosen, weights = self.router(h)
        projected = project(h, self._input_projections(), None if fused is None else fused.inputs)
        z = h if self.latent_dim is None else projected.pop(0)
        if fused is None or fused.experts is None:
            counts = self.last_load = torch.bincount(chosen.flatten(), minlength=len(self.experts))
            routed = self.experts(z, chosen, weights, counts)
        else:  # decoding from the stacks: no load count (its size depends on the routing)
            routed = self.experts(z, chosen, weights, None, stack=fused.experts)
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
