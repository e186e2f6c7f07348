"""MoE: both dispatch paths == a dense all-experts reference; routing and bias update as specified."""

from __future__ import annotations

import pytest
import torch

from k3.layers.moe import MoE


def dense_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, combined with a dense [N, E] weight matrix."""
    h = x.reshape(-1, x.shape[-1])
    chosen, weights = moe.gate(h)
    dense_w = torch.zeros(h.shape[0], len(moe.experts), dtype=weights.dtype).scatter(1, chosen, weights)
    z = h if moe.latent_dim is None else moe.latent_down_proj(h)
    routed = sum(dense_w[:, e : e + 1].to(z.dtype) * expert(z) for e, expert in enumerate(moe.experts))
    if moe.latent_dim is not None:
        routed = moe.latent_up_proj(moe.latent_norm(routed))
    if moe.shared_experts is not None:
        routed = routed + moe.shared_experts(h)
    return routed.view(x.shape)


CONFIGS = {
    "kimi-linear": dict(
        num_experts=8,
        top_k=2,
        expert_hidden=12,
        num_shared=1,
        latent_dim=None,
        activation="swiglu",
        routed_scaling_factor=2.446,
    ),
    "k3-latent": dict(
        num_experts=8,
        top_k=3,
        expert_hidden=12,
        num_shared=2,
        latent_dim=10,
        activation="situ",
        routed_scaling_factor=1.0,
    ),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_grouped_dispatch_equals_dense(name):
    """Grouped dispatch equals running every expert on every token, with gradients."""
    torch.manual_seed(0)
    moe = MoE(16, **CONFIGS[name]).double()
    with torch.no_grad():
        moe.gate.e_score_correction_bias.normal_()  # selection differs from the raw scores
    x = torch.randn(3, 7, 16, dtype=torch.float64)
    x.requires_grad_(True)
    y = moe(x)
    torch.testing.assert_close(y, dense_reference(moe, x))
    assert int(moe.last_load.sum()) == 3 * 7 * CONFIGS[name]["top_k"]
    grads = torch.autograd.grad(y.sum(), [x, moe.experts[0].w1])
    ref = torch.autograd.grad(dense_reference(moe, x).sum(), [x, moe.experts[0].w1])
    torch.testing.assert_close(grads, ref)


def test_routing_weights_and_bias_role():
    """Weights are the unbiased sigmoid scores of the chosen experts, renormalised, times the scaling;
    the bias changes which experts are chosen, never the weights' formula."""
    torch.manual_seed(1)
    moe = MoE(16, num_experts=6, top_k=2, expert_hidden=8, routed_scaling_factor=2.5)
    h = torch.randn(5, 16)
    with torch.no_grad():
        moe.gate.e_score_correction_bias.copy_(torch.tensor([10.0, 10.0, 0, 0, 0, 0]))
        chosen, weights = moe.gate(h)
    assert (chosen.sort(-1).values == torch.tensor([0, 1])).all()
    scores = torch.sigmoid(h @ moe.gate.weight.T)[:, :2]
    torch.testing.assert_close(weights.sort(-1).values, (scores / scores.sum(-1, keepdim=True) * 2.5).sort(-1).values)


def test_bias_update_moves_against_load():
    moe = MoE(8, num_experts=4, top_k=1, expert_hidden=4)
    moe.update_bias(torch.tensor([10, 0, 5, 5]), rate=0.01)
    torch.testing.assert_close(moe.gate.e_score_correction_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    with pytest.raises(ValueError, match="`top_k`"):
        MoE(8, num_experts=4, top_k=5, expert_hidden=4)


def test_names_follow_kimi_checkpoints():
    names = {n for n, _ in MoE(8, num_experts=3, top_k=1, expert_hidden=4).named_parameters()}
    assert {"gate.weight", "experts.2.w1", "experts.2.w2", "experts.2.w3", "shared_experts.gate_proj.weight"} <= names
    assert "gate.e_score_correction_bias" in MoE(8, num_experts=3, top_k=1, expert_hidden=4).state_dict()


def values_and_grads(moe: MoE, x: torch.Tensor, params: list, **kwargs) -> tuple:
    y = moe(x, **kwargs)
    return y, torch.autograd.grad(y.sum(), params, allow_unused=True)


def assert_equals_dense(moe: MoE, x: torch.Tensor, params: list) -> tuple:
    """The layer's output and gradients equal the dense reference's (float64 rounding); returns them."""
    y, grads = values_and_grads(moe, x, params)
    want, want_grads = (
        dense_reference(moe, x),
        torch.autograd.grad(dense_reference(moe, x).sum(), params, allow_unused=True),
    )
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, want_grads):
        if a is None:  # an expert no token chose: no gradient (the reference's is zero)
            assert b is None or not b.any()
        else:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    return y, grads


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("tokens", [1, 3, 36])
def test_slots_and_gathered_paths_equal_the_dense_reference(name, tokens):
    """The two dispatch paths: the slots (no copies given: training, prefill, eager decoding), values and
    gradients, and the decode step's gathered path (the experts stacked, `fuse_for_decoding`), for a few
    tokens and for many."""
    torch.manual_seed(1)
    moe = MoE(16, **CONFIGS[name]).double()
    x = torch.randn(tokens, 1, 16, dtype=torch.float64, requires_grad=True)
    y, _ = assert_equals_dense(moe, x, [x, moe.experts[0].w1, moe.experts[3].w2])
    with torch.no_grad():
        gathered = moe(x, fused=moe.fuse_for_decoding())
    torch.testing.assert_close(gathered, y, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", CONFIGS)
def test_balanced_and_one_sided_routings_run_in_slots(name):
    """A balanced routing: one slot per expert; every token to the same experts: they take whole slots,
    nothing padded. Values and gradients equal the dense reference."""
    torch.manual_seed(2)
    moe = MoE(16, **CONFIGS[name]).double()
    x = torch.randn(4, 9, 16, dtype=torch.float64, requires_grad=True)
    params = [x, moe.experts[1].w1, moe.experts[5].w3, moe.experts[2].w2]
    assert_equals_dense(moe, x, params)
    with torch.no_grad():
        moe.gate.e_score_correction_bias.copy_(torch.arange(8, dtype=torch.float64) * 100)
    assert_equals_dense(moe, x, params)


@pytest.mark.parametrize("name", CONFIGS)
def test_skewed_routing_runs_in_slots(name):
    """A skewed routing (one expert drawing about half the tokens, as training's routing drifts before the
    bias corrects it): the busy expert takes several slots within the slots run (their number set by the
    shapes alone); values and gradients equal the dense reference, and an expert no token chose gets a
    zero gradient (every held expert is stacked)."""
    from k3.layers.moe import slot_capacity

    torch.manual_seed(3)
    moe = MoE(16, **CONFIGS[name]).double()
    with torch.no_grad():
        moe.gate.e_score_correction_bias[3] = 5.0  # expert 3 in (almost) every token's top-k
        moe.gate.e_score_correction_bias[6] = -5.0  # expert 6 in none
    x = torch.randn(4, 25, 16, dtype=torch.float64, requires_grad=True)
    h = x.reshape(-1, 16)
    counts = torch.bincount(moe.router(h)[0].flatten(), minlength=8)
    assignments = int(counts.sum())
    capacity = slot_capacity(assignments, 8)
    slots = (assignments + 8 * (capacity - 1)) // capacity
    assert int(((counts + capacity - 1) // capacity).sum()) <= slots  # the bound holds
    assert int(counts[3]) > capacity and int(counts[6]) == 0
    params = [x, moe.experts[3].w1, moe.experts[0].w3, moe.experts[2].w2, moe.experts[6].w1]
    _, grads = assert_equals_dense(moe, x, params)
    assert grads[-1] is not None and not grads[-1].any()


def test_slot_capacity_is_one_for_a_few_tokens_and_bounds_the_padding():
    """Decoding (a few assignments per expert) runs one slot per assignment; many tokens run slots whose
    padding, experts x (capacity - 1) rows at most, is a fraction of the work."""
    from k3.layers.moe import slot_capacity

    assert slot_capacity(1, 16) == slot_capacity(8, 16) == slot_capacity(16, 16) == 1
    for assignments, experts in [(8192, 16), (4096, 8), (65536, 64)]:
        capacity = slot_capacity(assignments, experts)
        assert 1 < capacity and experts * (capacity - 1) <= assignments


def test_experts_held_elsewhere_are_skipped():
    """Expert parallelism: with some experts None, the slots run the held ones only, as the dense reference
    over the held experts (the others' tokens are computed by their processes)."""
    torch.manual_seed(4)
    moe = MoE(16, **CONFIGS["kimi-linear"]).double()
    z = torch.randn(11, 16, dtype=torch.float64)
    chosen, weights = moe.router(z)
    held = [moe.experts[e] for e in range(8)]
    for e in (1, 4, 5):
        moe.experts[e] = None
    dense_w = torch.zeros(11, 8, dtype=weights.dtype).scatter(1, chosen, weights)
    want = sum(dense_w[:, e : e + 1] * held[e](z) for e in range(8) if moe.experts[e] is not None)
    torch.testing.assert_close(moe.experts(z, chosen, weights), want)
    torch.testing.assert_close(moe.experts(z, chosen, weights, stack=moe.experts.stack_for_decoding()), want)
    none_held = moe.experts(z, chosen.fill_(1), weights)
    assert torch.equal(none_held, torch.zeros_like(z))


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_grouped_gemm_equals_the_dense_reference(name, dtype):
    """float32 and bfloat16 with 16-byte rows run the grouped GEMM (many tokens: capacity > 1): values and
    gradients against the float64 dense reference, to the dtype's tolerance; a few tokens run in slots."""
    from k3.layers.moe import grouped_mm_runs, slot_capacity

    torch.manual_seed(5)
    config = {**CONFIGS[name], "expert_hidden": 16} | ({"latent_dim": 8} if CONFIGS[name]["latent_dim"] else {})
    reference = MoE(16, **config).double()
    moe = MoE(16, **config).to(dtype)
    moe.load_state_dict(reference.state_dict())
    x64 = torch.randn(4, 16, 16, dtype=torch.float64, requires_grad=True)
    x = x64.detach().to(dtype).requires_grad_()
    stack = tuple(torch.stack([getattr(e, n) for e in moe.experts]) for n in ("w1", "w3", "w2"))
    assert grouped_mm_runs(x, stack) and slot_capacity(64 * CONFIGS[name]["top_k"], 8) > 1
    want = dense_reference(reference, x64.detach().to(dtype).double())
    got = moe(x)
    tol = {torch.float32: 1e-5, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    got.sum().backward()
    want_grad = torch.autograd.grad(dense_reference(reference, x64).sum(), x64)[0]
    torch.testing.assert_close(x.grad.double(), want_grad, rtol=tol * 10, atol=tol * 10)
    w1 = moe.experts[2].w1.grad.double()
    ref_w1 = torch.autograd.grad(dense_reference(reference, x64).sum(), reference.experts[2].w1)[0]
    torch.testing.assert_close(w1, ref_w1, rtol=tol * 10, atol=tol * 10)
    with torch.no_grad():  # one token: slots of one row
        torch.testing.assert_close(moe(x[:1, :1]).double(), want[:1, :1], rtol=tol, atol=tol)


def test_experts_held_elsewhere_in_the_grouped_gemm():
    """Expert parallelism in float32 (the grouped GEMM): the assignments to experts held elsewhere run against
    zero matrices and add nothing."""
    torch.manual_seed(6)
    moe = MoE(16, **CONFIGS["kimi-linear"])
    z = torch.randn(40, 16)
    chosen, weights = moe.router(z)
    held = list(moe.experts)
    for e in (1, 4, 5):
        moe.experts[e] = None
    dense_w = torch.zeros(40, 8).scatter(1, chosen, weights)
    want = sum(dense_w[:, e : e + 1] * held[e](z) for e in range(8) if moe.experts[e] is not None)
    torch.testing.assert_close(moe.experts(z, chosen, weights), want, rtol=1e-5, atol=1e-5)


def test_float32_experts_compile_whole():
    """Under torch.compile (fullgraph; aot_eager traces with the ops' shape functions, as inductor does) a
    float32 MoE runs its grouped GEMM (`k3::grouped_mm`, whose shape function takes every dtype it runs):
    values and gradients equal eager's."""
    torch.manual_seed(7)
    config = {**CONFIGS["kimi-linear"], "expert_hidden": 16}
    moe = MoE(16, **config)
    x = torch.randn(4, 16, 16, requires_grad=True)
    eager = moe(x)
    (grad,) = torch.autograd.grad(eager.sum(), x)
    torch._dynamo.reset()
    compiled = torch.compile(moe, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.autograd.grad(compiled.sum(), x)[0], grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_grouped_mm_op_equals_the_groups_matmuls(dtype):
    """k3::grouped_mm (and its backward, through k3::grouped_mm_weight) equals each group's rows times its
    matrix, empty groups included; torch.library.opcheck checks its registrations (shape function,
    autograd) against the real op."""
    from k3.layers.grouped_mm import grouped_mm

    torch.manual_seed(8)
    ends = [3, 3, 9, 16]  # the second group empty
    x = torch.randn(16, 8, dtype=torch.float64)
    w = torch.randn(4, 8, 16, dtype=torch.float64)
    offsets = torch.tensor(ends, dtype=torch.int32)
    want = torch.cat([x[a:b] @ w[g] for g, (a, b) in enumerate(zip([0] + ends[:-1], ends))])
    xd, wd = x.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
    got = grouped_mm(xd, wd, offsets)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * 8)
    dy = torch.randn(16, 16, dtype=torch.float64)
    got.backward(dy.to(dtype))
    x64, w64 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.cat([x64[a:b] @ w64[g] for g, (a, b) in enumerate(zip([0] + ends[:-1], ends))]).backward(dy)
    torch.testing.assert_close(xd.grad.double(), x64.grad, rtol=tol, atol=tol * 8)
    torch.testing.assert_close(wd.grad.double(), w64.grad, rtol=tol, atol=tol * 8)
    torch.library.opcheck(
        grouped_mm, (x.detach().to(dtype).requires_grad_(), w.detach().to(dtype).requires_grad_(), offsets)
    )


@pytest.mark.parametrize("name", CONFIGS)
def test_the_grouped_gemm_equals_the_slots_in_float64(name, monkeypatch):
    """In float64 (exact) the grouped path (the assignments sorted by expert, one grouped GEMM per matrix;
    what a GPU runs) and the slots of batched matmuls (what float64 ran before the grouped path existed)
    give the same output and gradients, experts held elsewhere included."""
    from k3.layers import moe as moe_module

    torch.manual_seed(10)
    config = {**CONFIGS[name], "expert_hidden": 12} | ({"latent_dim": 8} if CONFIGS[name]["latent_dim"] else {})
    moe = MoE(16, **config).double()
    moe.experts[3] = None
    x = torch.randn(3, 21, 16, dtype=torch.float64)
    results = {}
    for grouped in (True, False):
        monkeypatch.setattr(moe_module, "grouped_mm_runs", lambda z, stack, grouped=grouped: grouped)
        xg = x.clone().requires_grad_()
        out = moe(xg)
        out.square().sum().backward()
        results[grouped] = (out, xg.grad, moe.experts[2].w1.grad.clone(), moe.experts[5].w2.grad.clone())
        moe.zero_grad()
    for got, want in zip(results[True], results[False]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_no_tokens_give_no_rows():
    """A process that received no tokens (expert parallelism) runs the experts on none: [0, d] out, in the
    decoding path (slots of one row) and through the whole MoE."""
    torch.manual_seed(9)
    moe = MoE(16, **CONFIGS["kimi-linear"])
    z = torch.randn(0, 16)
    chosen, weights = moe.router(z)
    assert moe.experts(z, chosen, weights).shape == (0, 16)
    assert moe(torch.randn(1, 0, 16)).shape == (1, 0, 16)
