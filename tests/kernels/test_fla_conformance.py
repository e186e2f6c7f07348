"""fla's kernels through k3's dispatch equal k3's own forms: argument layouts, gate conventions, scales,
states, packed sequences and gradients, checked on CPU tensors through Triton's interpreter.

Each test runs a public k3 op on float32 inputs with `use_kernels("fla")` (fla's Triton kernels,
interpreted) and compares the outputs, final states and every gradient at relative 1e-5 with k3's own
chunk form (`use_kernels("torch")`) on the same numbers in float64: fla's own float32 rounding is
measured, not the sum of two roundings (k3's float32 form is itself ~1e-6 to 1e-5 from float64 on a
gradient summed over T, such as Gated DeltaNet's dg). Shapes are tiny: an interpreted kernel call takes
seconds. (fla's chunk kernels in bfloat16 cannot be checked here: the interpreter mis-computes them for
Gated DeltaNet and DeltaNet alike, while the same inputs in float32 agree to 1e-7. k3 runs bfloat16
on a GPU only, where `k3 bench gpu` runs tests/ops/test_cuda.py.)
"""

from __future__ import annotations

import logging

import pytest
import torch

import k3.ops as ops
from k3.ops import delta_family
from k3.ops.kernels import use_kernels

from ..ops.helpers import DELTA, GDN_HARD, KDA_HARD, make_inputs, rel_err
from .conftest import READY, REASON

pytestmark = [pytest.mark.kernels, pytest.mark.skipif(not READY, reason=REASON)]

TOL = 1e-5
OPS = {"kda": KDA_HARD, "gated_delta_rule": GDN_HARD, "delta_rule": DELTA}  # unbounded gates, -5 sigmoid aside
GATED = ["kda", "gated_delta_rule"]


@pytest.fixture(autouse=True)
def float32_deltanet(monkeypatch):
    """fla's public chunk_delta_rule refuses float32 (and k3 follows it on a GPU); its kernels run float32
    through the interpreter exactly, which is what checks k3's mapping onto them here."""
    monkeypatch.setattr(delta_family, "FLA_FLOAT32_DELTANET", True)


def make(name, B, T, H, K, V, *, seed=0, states=None, gate_kind=None, neg_inf_at=None):
    """Float32 inputs of op `name` (`tests/ops/helpers.make_inputs`, drawn in float64) as leaves: `states` initial
    states, `gate_kind` "safe" for Kimi K3's -5 sigmoid gate, a g of -inf at step `neg_inf_at`."""
    x = make_inputs(
        OPS[name], B, T, H, K, V, torch.float32, seed=seed, initial_state=states is not None, N=states,
        gate_kind=gate_kind,
    )  # fmt: skip
    if neg_inf_at is not None:
        x["g"][(0, neg_inf_at, 0)] = -float("inf")
    return {n: t.requires_grad_() for n, t in x.items()}  # leaves, with gradients


def run(form, x, **options):
    """(outputs, gradients) of `form` on fresh copies of x: o, the final state, d/d every input."""
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    order = ["q", "k", "v", "g", "beta"] if "g" in leaves else ["q", "k", "v", "beta"]
    o, S = form(*(leaves[n] for n in order), initial_state=leaves.get("initial_state"), **options)
    weights = torch.randn(o.shape, generator=torch.Generator().manual_seed(1))
    loss = (o * weights).sum() + (0 if S is None else S.square().sum())
    loss.backward()
    return {"o": o, "final_state": S}, {f"d{n}": t.grad for n, t in leaves.items()}


def assert_same(name, x, form, **options):
    with use_kernels("fla"):
        fla_out, fla_grads = run(form, x, **options)
    with use_kernels("torch"):
        x64 = {n: t.detach().double().requires_grad_() for n, t in x.items()}
        ref_out, ref_grads = run(OPS[name].chunk, x64, **options)
    for what, ref in {**ref_out, **ref_grads}.items():
        got = {**fla_out, **fla_grads}[what]
        if ref is None:
            assert got is None, what
            continue
        assert got is not None and got.shape == ref.shape and got.dtype == torch.float32, what
        assert torch.isfinite(got).all(), what
        assert rel_err(got, ref) < TOL, f"{name} {what}: rel {rel_err(got, ref):.2e}"


@pytest.mark.parametrize("name", OPS)
def test_chunk_forward_state_and_gradients(name):
    """T = 37 (not a multiple of the chunk), B = 2, an initial state, L2-normalised q and k, a scale."""
    x = make(name, B=2, T=37, H=2, K=16, V=8, states=2)
    assert_same(name, x, OPS[name].chunk, output_final_state=True, use_qk_l2norm=True, scale=0.3, chunk_size=32)


@pytest.mark.parametrize("name", OPS)
def test_chunk_packed_sequences(name):
    """Three sequences packed along T by cu_seqlens (B = 1), one initial state each."""
    x = make(name, B=1, T=45, H=2, K=16, V=8, states=3, seed=1)
    cu = torch.tensor([0, 5, 29, 45])
    assert_same(name, x, OPS[name].chunk, output_final_state=True, use_qk_l2norm=True, cu_seqlens=cu, chunk_size=32)


@pytest.mark.parametrize("name", OPS)
def test_chunk_shorter_than_a_chunk_without_states(name):
    """T < chunk, H = 1, odd head dims, no initial state and no final state asked for."""
    x = make(name, B=1, T=11, H=1, K=7, V=5, seed=2)
    assert_same(name, x, OPS[name].chunk, use_qk_l2norm=True, chunk_size=64)


def test_kda_at_the_safe_gates_bound():
    """Kimi K3's safe gate: g = -5 sigmoid(.), stated as lower_bound = -5 (fla's safe_gate path)."""
    x = make("kda", B=1, T=40, H=2, K=16, V=8, states=1, gate_kind="safe", seed=3)
    assert_same("kda", x, ops.chunk_kda, output_final_state=True, use_qk_l2norm=True, lower_bound=-5.0, chunk_size=32)


@pytest.mark.parametrize("name", GATED)
def test_a_gate_step_of_minus_infinity_clears_the_state(name):
    """g = -inf at one step forgets everything before it: k3 clamps it as its own forms do."""
    x = make(name, B=1, T=40, H=2, K=16, V=8, states=1, neg_inf_at=17, seed=4)
    assert_same(name, x, OPS[name].chunk, output_final_state=True, use_qk_l2norm=True, chunk_size=32)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("T", [1, 9])
def test_recurrent_form_packed_and_batched(name, T):
    """fla's fused recurrent kernel (the decode kernel) equals k3's, batched and packed, forward only."""
    recurrent = OPS[name].recurrent
    x = make(name, B=2, T=T, H=2, K=16, V=8, states=2, seed=5)
    order = [n for n in ("q", "k", "v", "g", "beta") if n in x]
    with torch.no_grad():
        for packed in (False, True):
            inputs = [x[n].detach() for n in order]
            S0 = x["initial_state"].detach()
            options = {}
            if packed:
                inputs = [t.reshape(1, 2 * T, *t.shape[2:]) for t in inputs]
                options["cu_seqlens"] = torch.tensor([0, T, 2 * T])
            with use_kernels("fla"):
                o, S = recurrent(*inputs, initial_state=S0, output_final_state=True, use_qk_l2norm=True, **options)
            with use_kernels("torch"):
                o_ref, S_ref = recurrent(
                    *(t.double() for t in inputs),
                    initial_state=S0.double(),
                    output_final_state=True,
                    use_qk_l2norm=True,
                    **options,
                )
            assert rel_err(o, o_ref) < TOL and rel_err(S, S_ref) < TOL, (packed, rel_err(o, o_ref), rel_err(S, S_ref))


def test_the_fla_path_runs_fla(monkeypatch):
    """With fla chosen, the ops call the custom ops (not k3's forms that would also agree)."""
    calls = []
    chunk, recurrent = torch.ops.k3.fla_chunk_delta, torch.ops.k3.fla_recurrent_delta
    monkeypatch.setattr(torch.ops.k3, "fla_chunk_delta", lambda *a: calls.append("chunk") or chunk(*a))
    monkeypatch.setattr(torch.ops.k3, "fla_recurrent_delta", lambda *a: calls.append("recurrent") or recurrent(*a))
    x = {n: t.detach() for n, t in make("kda", B=1, T=8, H=1, K=8, V=8).items()}
    with use_kernels("fla"), torch.no_grad():
        ops.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=32)
        ops.recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"])
    assert calls == ["chunk", "recurrent"]


@pytest.mark.parametrize(
    "case, why",
    [
        (dict(dtype=torch.float64), "dtype torch.float64"),
        (dict(chunk_size=16), "chunk_size = 16"),
        (dict(grad=True, recurrent=True), "a gradient through the recurrent form"),
    ],
)
def test_what_fla_cannot_take_runs_k3s_form_and_says_so(case, why, caplog, monkeypatch):
    monkeypatch.setattr(torch.ops.k3, "fla_chunk_delta", None)  # any call to fla would fail
    monkeypatch.setattr(torch.ops.k3, "fla_recurrent_delta", None)
    x = make("kda", B=1, T=8, H=1, K=8, V=8)
    x = {
        n: t.detach().to(case.get("dtype", torch.float32)).requires_grad_(case.get("grad", False)) for n, t in x.items()
    }
    form = ops.recurrent_kda if case.get("recurrent") else ops.chunk_kda
    options = {} if case.get("recurrent") else {"chunk_size": case.get("chunk_size", 32)}
    with use_kernels("fla"), caplog.at_level(logging.DEBUG, logger="k3.ops.kernels"):
        o, _ = form(x["q"], x["k"], x["v"], x["g"], x["beta"], **options)
    assert o.shape == (1, 8, 1, 8)
    assert any(why in r.getMessage() and "k3's own form runs" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("gate", ["channel", "head", "none"])
def test_the_custom_ops_pass_opcheck(gate):
    """torch.library.opcheck: the schema holds, the fake implementation's shapes and dtypes equal the real
    ones, and autograd goes through the registered backward. (Its AOT-dispatch check compares every
    output, and fla leaves parts of the intra-chunk matrices it returns for the backward unwritten; the
    compile test below checks what the compiled op computes.)"""
    name = {"channel": "kda", "head": "gated_delta_rule", "none": "delta_rule"}[gate]
    x = make(name, B=1, T=10, H=1, K=8, V=8, states=2, seed=6)
    q, k, v, beta, S0 = (x[n] for n in ("q", "k", "v", "beta", "initial_state"))
    q, k = ops.l2norm(q.detach()).requires_grad_(), ops.l2norm(k.detach()).requires_grad_()
    cu = torch.tensor([0, 4, 10])
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    args = (q, k, v, x.get("g"), beta, S0, cu, gate, 0.5, 32, None)
    torch.library.opcheck(torch.ops.k3.fla_chunk_delta, args, test_utils=checks)
    with torch.no_grad():
        plain = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in args[:9])
        torch.library.opcheck(torch.ops.k3.fla_recurrent_delta, plain, test_utils=checks[::2])


@pytest.mark.parametrize("name", OPS)
def test_the_ops_compile_whole_with_fla_inside(name):
    """A function around the public op compiles with fullgraph=True (no graph break at fla's call) and gives
    eager's outputs and gradients, through AOT autograd's forward and backward graphs."""
    chunk = OPS[name].chunk
    x = make(name, B=1, T=20, H=2, K=8, V=8, states=1, seed=7)
    order = [n for n in ("q", "k", "v", "g", "beta") if n in x]

    def step(*inputs):
        *tensors, S0 = inputs
        o, S = chunk(*tensors, initial_state=S0, output_final_state=True, use_qk_l2norm=True, chunk_size=32,
                     check_values=False)  # fmt: skip
        return o.square().sum() + S.sum()

    inputs = [x[n] for n in order] + [x["initial_state"]]
    with use_kernels("fla"):
        eager = torch.autograd.grad(step(*inputs), inputs)
        torch._dynamo.reset()
        compiled_step = torch.compile(step, fullgraph=True, backend="aot_eager")
        compiled = torch.autograd.grad(compiled_step(*inputs), inputs)
    for n, a, b in zip(order + ["initial_state"], compiled, eager):
        assert rel_err(a, b) < 1e-6, (name, n, rel_err(a, b))


def test_a_kimi_k3_training_step_compiles_whole_with_fla_inside():
    """kimi-k3-tiny's training forward and backward, with fla's KDA kernels in its three KDA layers, compile
    as one graph (aot_eager) and equal k3's own kernels run eager: loss and every parameter's gradient."""
    from torch._dynamo.backends.debugging import aot_eager

    from k3.models import CausalLM, get_config

    torch.manual_seed(0)
    model = CausalLM(get_config("kimi-k3-tiny"))
    ids = torch.randint(0, model.config.vocab_size, (1, 40))
    with use_kernels("torch"):
        reference = model(ids, targets=ids)
        reference.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    traced = []

    def aot_eager_recording(graph, example_inputs):
        traced.extend(n.target for n in graph.graph.nodes if n.op == "call_function")
        return aot_eager(graph, example_inputs)

    torch._dynamo.reset()
    with use_kernels("fla"):
        loss = torch.compile(lambda ids: model(ids, targets=ids), fullgraph=True, backend=aot_eager_recording)(ids)
        loss.backward()
    assert traced.count(torch.ops.k3.fla_chunk_delta) == 3, [t for t in traced if "k3" in str(t)]  # one per KDA layer
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-5)
    for (n, p), want in zip(model.named_parameters(), expected):
        assert rel_err(p.grad, want) < 1e-4, (n, rel_err(p.grad, want))


def test_under_bf16_autocast_fla_gets_bfloat16_inputs(monkeypatch):
    """`k3 train --precision bf16`: a layer hands q, k, v over in float32 (k3's forms accumulate in it);
    fla's kernels get them in autocast's bfloat16, as a matmul would, beta and g as given, and the output
    comes back in q's dtype. (Only the dtypes: the interpreter cannot compute fla's bfloat16 kernels.)"""
    seen = []
    chunk = torch.ops.k3.fla_chunk_delta

    def spy(*args):
        seen.append([a.dtype if isinstance(a, torch.Tensor) else a for a in args[:5]])
        return chunk(*args)

    monkeypatch.setattr(torch.ops.k3, "fla_chunk_delta", spy)
    x = {n: t.detach() for n, t in make("kda", B=1, T=8, H=1, K=8, V=8).items()}
    with use_kernels("fla"), torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        o, _ = ops.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=32, use_qk_l2norm=True)
    assert seen == [[torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32, torch.float32]]
    assert o.dtype == torch.float32
    # DeltaNet, which fla takes in bfloat16 only: float32 runs k3's form, under autocast fla's kernel
    monkeypatch.setattr(delta_family, "FLA_FLOAT32_DELTANET", False)
    seen.clear()
    with use_kernels("fla"), torch.no_grad():
        ops.chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"], chunk_size=32)
        assert seen == []
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ops.chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"], chunk_size=32)
    assert seen == [[torch.bfloat16, torch.bfloat16, torch.bfloat16, None, torch.float32]]


def test_the_device_checks_op_cases_run_through_the_interpreter():
    """`k3 bench gpu`'s op cases (its calls of k3's dispatch and of fla directly, safe gate included) run
    at toy sizes through the interpreter, so a GPU session does not find a wrong argument first."""
    import fla.ops.gated_delta_rule.chunk as gdn_chunk
    import fla.ops.kda.chunk_fwd as kda_chunk

    from k3.bench import gpu

    calls = []
    with use_kernels("fla"), pytest.MonkeyPatch.context() as patch:
        for module, name in ((kda_chunk, "chunk_kda_fwd"), (gdn_chunk, "chunk_gated_delta_rule_fwd")):
            original = getattr(module, name)
            patch.setattr(module, name, lambda *a, f=original, n=name, **kw: calls.append(n) or f(*a, **kw))
        rows = gpu.time_ops(gpu.TINY, torch.device("cpu"), say=lambda *_: None)
    assert {"chunk_kda_fwd", "chunk_gated_delta_rule_fwd"} <= set(calls)  # k3's dispatch ran fla's kernels
    assert [r["op"] for r in rows] == ["kda", "kda", "gdn", "gdn"]
    assert all(set(r["ms"]) == {"k3 (dispatch)", "k3 PyTorch form", "fla direct"} for r in rows)
    assert all(r["dispatch / fla"] > 0 for r in rows)
