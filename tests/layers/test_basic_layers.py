"""RMSNorm, the FFN family (GELU MLP, SwiGLU, SiTU-GLU) and ShortConvolution against their formulas."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from k3.layers import GatedMLP, GeluMLP, RMSNorm, ShortConvolution, situ


def test_rmsnorm_formula_and_dtype():
    """y = x / sqrt(mean(x^2) + eps) * w; statistics in float32 for bf16 input."""
    torch.manual_seed(0)
    norm = RMSNorm(10, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 7, 10, dtype=torch.float64)
    ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    torch.testing.assert_close(norm.double()(x), ref)
    xb = torch.randn(4, 10).bfloat16()
    y = RMSNorm(10)(xb)
    assert y.dtype == torch.float32  # float32 weight times the bf16-cast normalised input
    assert RMSNorm(10).bfloat16()(xb).dtype == torch.bfloat16  # a bf16 model stays bf16
    ref_b = (xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    torch.testing.assert_close(y.float(), ref_b.float(), rtol=1e-2, atol=1e-2)


def test_rmsnorm_backward_equals_autograd_through_the_formula():
    """RMSNorm's hand-derived backward (x and weight gradients) equals autograd through the formula in
    float64, to 1e-12, including a row of zeros (r = eps^-1/2); gradcheck passes."""
    from k3.layers.norm import rms_norm

    torch.manual_seed(0)
    x = torch.randn(3, 4, 9, dtype=torch.float64) * 3
    x[0, 0] = 0.0
    x.requires_grad_()
    w = (torch.rand(9, dtype=torch.float64) + 0.5).requires_grad_()
    seed = torch.randn(3, 4, 9, dtype=torch.float64)
    got = torch.autograd.grad((rms_norm(x, w, 1e-6) * seed).sum(), [x, w])
    want = torch.autograd.grad((x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w * seed).sum(), [x, w])
    for g, ref in zip(got, want):
        assert ((g - ref).norm() / ref.norm()).item() <= 1e-12
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, 1e-6), (x[:, :2].detach().requires_grad_(), w))
    norm = RMSNorm(9).double()
    assert norm(x).grad_fn is not None and norm(x.detach()).grad_fn is not None  # the weight still learns


def test_situ_hand_value():
    """situ(2, 3) with beta = 4, l_beta = 25: 4 tanh(1/2) sigma(2) * 25 tanh(3/25)."""
    expected = 4 * math.tanh(0.5) / (1 + math.exp(-2)) * 25 * math.tanh(3 / 25)
    got = situ(torch.tensor([2.0], dtype=torch.float64), torch.tensor([3.0], dtype=torch.float64))
    assert abs(got.item() - expected) < 1e-12


def test_situ_tends_to_swiglu_and_is_bounded():
    """beta -> inf without l_beta is SwiGLU; |a| <= beta and |u| <= l_beta always (tanh saturates)."""
    torch.manual_seed(0)
    gate, up = torch.randn(1000, dtype=torch.float64) * 50, torch.randn(1000, dtype=torch.float64) * 50
    torch.testing.assert_close(situ(gate, up, beta=1e9, linear_beta=None), F.silu(gate) * up)
    a = situ(gate, torch.ones_like(up), beta=4.0, linear_beta=None)
    assert a.abs().max() <= 4.0 and a.abs().max() > 3.9
    u = situ(torch.full_like(gate, 100.0), up, beta=1e9, linear_beta=25.0) / 100.0
    assert u.abs().max() <= 25.0
    assert situ(gate.float(), up.float()).dtype == torch.float32


@pytest.mark.parametrize("activation", ["swiglu", "situ"])
def test_gated_mlp_matches_formula(activation):
    torch.manual_seed(1)
    mlp = GatedMLP(12, 20, activation=activation).double()
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    gate, up = x @ mlp.gate_proj.weight.T, x @ mlp.up_proj.weight.T
    hidden = situ(gate, up, 4.0, 25.0) if activation == "situ" else F.silu(gate) * up
    torch.testing.assert_close(mlp(x), hidden @ mlp.down_proj.weight.T)
    assert {n for n, _ in mlp.named_parameters()} == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}


def test_gated_mlp_rejects_unknown_activation():
    with pytest.raises(ValueError, match="`activation`"):
        GatedMLP(4, 8, activation="relu")


def test_gelu_mlp_is_gpt2s():
    """GPT-2 sizes: 768 -> 3072 -> 768 with biases = 4,722,432 parameters; tanh GELU."""
    mlp = GeluMLP(768)
    assert sum(p.numel() for p in mlp.parameters()) == 768 * 3072 + 3072 + 3072 * 768 + 768
    small = GeluMLP(6, 10).double()
    x = torch.randn(3, 6, dtype=torch.float64)
    h = x @ small.c_fc.weight.T + small.c_fc.bias
    h = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
    torch.testing.assert_close(small(x), h @ small.c_proj.weight.T + small.c_proj.bias)


@pytest.mark.parametrize("kernel_size", [1, 2, 4])
def test_short_conv_is_causal_depthwise_conv(kernel_size):
    """Equals F.conv1d with left zero padding, then SiLU."""
    torch.manual_seed(2)
    conv = ShortConvolution(5, kernel_size).double()
    x = torch.randn(2, 11, 5, dtype=torch.float64)
    ref = F.conv1d(F.pad(x.transpose(1, 2), (kernel_size - 1, 0)), conv.weight, groups=5)
    y, _ = conv(x)
    torch.testing.assert_close(y, F.silu(ref).transpose(1, 2))


@pytest.mark.parametrize("split", [0, 1, 3, 7, 11])
def test_short_conv_state_chaining(split):
    """Two calls chained through the conv state == one call; then token-by-token decode == one call."""
    torch.manual_seed(3)
    conv = ShortConvolution(4, 4).double()
    x = torch.randn(3, 11, 4, dtype=torch.float64)
    y, state = conv(x, output_final_state=True)
    y1, s1 = conv(x[:, :split], output_final_state=True)
    y2, s2 = conv(x[:, split:], conv_state=s1, output_final_state=True)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y)
    torch.testing.assert_close(s2, state)
    steps, s = [], None
    for t in range(11):
        y_t, s = conv(x[:, t : t + 1], conv_state=s, output_final_state=True)
        steps.append(y_t)
    torch.testing.assert_close(torch.cat(steps, 1), y)


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("kernel_size", [1, 4])
def test_short_conv_gradients(kernel_size, activation):
    """The convolution's own backward (shifted multiply-adds): gradients w.r.t. x, the weight and an
    incoming conv state equal autograd through F.conv1d (+ SiLU) in float64, and pass gradcheck."""
    torch.manual_seed(4)
    conv = ShortConvolution(5, kernel_size, activation).double()
    x = torch.randn(2, 9, 5, dtype=torch.float64, requires_grad=True)
    state = torch.randn(2, 5, kernel_size - 1, dtype=torch.float64, requires_grad=True)

    def reference(x, w, state):
        y = F.conv1d(torch.cat([state, x.transpose(1, 2)], -1), w, groups=5)
        return (F.silu(y) if activation else y).transpose(1, 2)

    seed = torch.randn(2, 9, 5, dtype=torch.float64)
    inputs = (x, conv.weight, state)
    got = torch.autograd.grad((conv(x, state)[0] * seed).sum(), inputs)
    want = torch.autograd.grad((reference(*inputs) * seed).sum(), inputs)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x, s: conv(x, s)[0], (x, state))


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("kernel_size, T", [(4, 9), (4, 2), (4, 1), (1, 5), (3, 3)])
def test_short_conv_gradients_from_the_start(kernel_size, T, activation):
    """No incoming state (training's case: the taps read x shifted, nothing padded): values and gradients
    w.r.t. x and the weight equal autograd through F.conv1d with left zeros, T shorter than the kernel
    included, and pass gradcheck."""
    torch.manual_seed(5)
    conv = ShortConvolution(5, kernel_size, activation).double()
    x = torch.randn(2, T, 5, dtype=torch.float64, requires_grad=True)

    def reference(x, w):
        y = F.conv1d(F.pad(x.transpose(1, 2), (kernel_size - 1, 0)), w, groups=5)
        return (F.silu(y) if activation else y).transpose(1, 2)

    seed = torch.randn(2, T, 5, dtype=torch.float64)
    torch.testing.assert_close(conv(x)[0], reference(x, conv.weight), rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad((conv(x)[0] * seed).sum(), (x, conv.weight))
    want = torch.autograd.grad((reference(x, conv.weight) * seed).sum(), (x, conv.weight))
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x: conv(x)[0], (x,))


def test_short_conv_bad_input():
    conv = ShortConvolution(4, 4)
    with pytest.raises(ValueError, match="`x`"):
        conv(torch.randn(2, 3, 5))
    with pytest.raises(ValueError, match="`conv_state`"):
        conv(torch.randn(2, 3, 4), conv_state=torch.zeros(2, 4, 2))
    with pytest.raises(ValueError, match="`kernel_size`"):
        ShortConvolution(4, 0)


def test_kda_safe_gate_follows_its_lower_bound():
    """g = b sigmoid(exp(A_log) (f + dt_bias)) for the configured floor b (K3's `gate_lower_bound`)."""
    from k3.layers.linear_attention import KimiDeltaAttention

    torch.manual_seed(0)
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    for bound in (-5.0, -3.0):
        layer = KimiDeltaAttention(32, 2, 8, kda_gate="safe", gate_lower_bound=bound).double()
        f = (layer.f_b_proj(layer.f_a_proj(x)) + layer.dt_bias).view(2, 5, 2, 8)
        want = bound * torch.sigmoid(torch.exp(layer.A_log).view(2, 1) * f)
        torch.testing.assert_close(layer.forget_gate(x), want, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="gate_lower_bound"):
        KimiDeltaAttention(32, 2, 8, kda_gate="safe", gate_lower_bound=0.0)


@pytest.mark.parametrize("top_k, renormalize", [(2, True), (2, False), (1, True)])
def test_router_weights_follow_kimi_k3s_renormalisation(top_k, renormalize):
    """w = s / (sum of the chosen s + 1e-20) x factor when renormalising with k > 1; otherwise s x factor."""
    from k3.layers.moe import Router

    torch.manual_seed(0)
    router = Router(16, 6, top_k, routed_scaling_factor=2.5, renormalize=renormalize)
    x = torch.randn(7, 16)
    chosen, weights = router(x)
    scores = router.scores(x).gather(-1, chosen)
    want = scores / (scores.sum(-1, keepdim=True) + 1e-20) if renormalize and top_k > 1 else scores
    torch.testing.assert_close(weights, want * 2.5)
