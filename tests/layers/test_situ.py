"""SiTU-GLU as one autograd function (k3.layers.ffn.situ) against the formula as written
(`situ_reference`, through autograd): values and gradients of both inputs, float64 to 1e-12, gradcheck,
float32 and bfloat16 inputs, with and without the linear beta."""

from __future__ import annotations

import pytest
import torch

from k3.layers.ffn import situ, situ_reference

# K3's; without the soft clip of up; other values; large betas (near SwiGLU)
BETAS = [(4.0, 25.0), (4.0, None), (1.5, 3.0), (100.0, 1e4)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def inputs(dtype: torch.dtype, shape=(67, 45), scale: float = 3.0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    gate = (scale * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    up = (scale * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    grad = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return gate, up, grad


def value_and_grads(fn, gate, up, grad, beta, linear_beta):
    out = fn(gate, up, beta, linear_beta)
    return (out, *torch.autograd.grad(out, (gate, up), grad))


@pytest.mark.parametrize("beta, linear_beta", BETAS)
def test_float64_equals_the_formula(beta, linear_beta):
    gate, up, grad = inputs(torch.float64, scale=4.0)
    with torch.no_grad():  # include large gates, where sigmoid and tanh saturate
        gate[0, :5] = torch.tensor([-800.0, -60.0, 0.0, 60.0, 800.0], dtype=torch.float64)
    got = value_and_grads(situ, gate, up, grad, beta, linear_beta)
    want = value_and_grads(situ_reference, gate, up, grad, beta, linear_beta)
    for name, a, b in zip(("out", "d gate", "d up"), got, want):
        assert a.dtype == torch.float64 and torch.isfinite(a).all(), name
        assert rel(a, b) <= 1e-12, name


@pytest.mark.parametrize("beta, linear_beta", BETAS)
def test_gradcheck(beta, linear_beta):
    gate, up, _ = inputs(torch.float64, shape=(6, 7))
    assert torch.autograd.gradcheck(lambda g, u: situ(g, u, beta, linear_beta), (gate, up))


@pytest.mark.parametrize("scale", [3.0, 0.02])  # activations of every size; small ones (as at initialisation)
@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("beta, linear_beta", BETAS)
def test_low_precision_inputs(dtype, rtol, beta, linear_beta, scale):
    """float32 and bfloat16 inputs: computed in float32, returned (and differentiated) in the inputs'
    dtype, as close to the exact values (the formula in float64 on the same inputs) as the formula
    itself in that dtype, within rtol; small inputs too, where a tanh formed as 2 sigmoid(2x) - 1 would
    lose its relative accuracy (1e-4 on inputs of 0.02)."""
    gate, up, grad = inputs(dtype, scale=scale)
    exact = value_and_grads(
        situ_reference, *(t.detach().double().requires_grad_() for t in (gate, up)), grad.double(), beta, linear_beta
    )
    got = value_and_grads(situ, gate, up, grad, beta, linear_beta)
    formula = value_and_grads(situ_reference, gate, up, grad, beta, linear_beta)
    for name, a, f, e in zip(("out", "d gate", "d up"), got, formula, exact):
        assert a.dtype == dtype, name
        assert rel(a, e) <= rtol, name
        assert rel(a, e) <= max(rel(f, e) * 8, 1e-6), name


def test_one_input_without_gradient_and_no_grad_mode():
    gate, up, grad = inputs(torch.float32)
    up = up.detach()
    out = situ(gate, up)
    (d_gate,) = torch.autograd.grad(out, (gate,), grad)
    torch.testing.assert_close(
        d_gate, torch.autograd.grad(situ_reference(gate, up), (gate,), grad)[0], rtol=1e-5, atol=1e-5
    )
    with torch.no_grad():
        assert not situ(gate, up).requires_grad


def test_bad_betas_are_refused():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="beta"):
        situ(x, x, beta=0.0)
    with pytest.raises(ValueError, match="linear_beta"):
        situ(x, x, linear_beta=-1.0)


@pytest.mark.parametrize("linear_beta", [25.0, None])
def test_what_the_backward_keeps(linear_beta):
    """float32 inputs keep the gate and the forward's tanh (no tanh in the backward); bfloat16 ones keep
    their two inputs alone (a float32 tanh would cost twice a bfloat16 input)."""
    gate, up, _ = inputs(torch.float32)
    saved = situ(gate, up, 4.0, linear_beta).grad_fn.saved_tensors
    third = torch.tanh(up / linear_beta) if linear_beta else up
    assert len(saved) == 3 and saved[0] is gate
    torch.testing.assert_close(saved[1], torch.tanh(gate / 4.0).detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(saved[2], third.detach(), rtol=1e-6, atol=0)
    gate, up, _ = inputs(torch.bfloat16)
    saved = situ(gate, up, 4.0, linear_beta).grad_fn.saved_tensors
    assert len(saved) == 2 and saved[0] is gate and saved[1] is up
