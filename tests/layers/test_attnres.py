"""Block AttnRes against a direct re-implementation of the article's block_attn_res."""

from __future__ import annotations

import pytest
import torch

from k3.layers.attnres import BlockAttnRes


def direct(blocks, partial, norm_weight, proj_weight, eps=1e-6):
    V = torch.stack(blocks + [partial])  # [N+1, B, T, D]
    K = V / torch.sqrt(V.pow(2).mean(-1, keepdim=True) + eps)
    logits = torch.einsum("d,nbtd->nbt", norm_weight * proj_weight.squeeze(), K)
    return torch.einsum("nbt,nbtd->btd", logits.softmax(0), V)


def test_matches_direct_formula():
    torch.manual_seed(0)
    layer = BlockAttnRes(16).double()
    with torch.no_grad():
        layer.norm.weight.uniform_(0.5, 1.5)
        layer.proj.weight.normal_()
    blocks = [torch.randn(2, 5, 16, dtype=torch.float64) * s for s in (1.0, 3.0, 0.2)]
    partial = torch.randn(2, 5, 16, dtype=torch.float64)
    torch.testing.assert_close(layer(blocks + [partial]), direct(blocks, partial, layer.norm.weight, layer.proj.weight))


def test_starts_as_uniform_average():
    """proj is zero-initialised: the first mix is the plain mean of the sources."""
    sources = [torch.randn(3, 8) for _ in range(4)]
    torch.testing.assert_close(BlockAttnRes(8)(sources), torch.stack(sources).mean(0))
    with pytest.raises(ValueError, match="`sources`"):
        BlockAttnRes(8)([])


def test_weights_give_the_modules_mix():
    """`weights` (what k3 lab inspect plots) are the softmax weights forward mixes the sources with."""
    torch.manual_seed(0)
    module = BlockAttnRes(16)
    torch.nn.init.normal_(module.proj.weight)
    sources = [torch.randn(2, 5, 16) * (i + 1) for i in range(3)]
    alpha = module.weights(sources)
    assert alpha.shape == (3, 2, 5) and torch.allclose(alpha.sum(0), torch.ones(2, 5))
    mix = sum(a.unsqueeze(-1) * v for a, v in zip(alpha, sources))
    assert torch.allclose(mix, module(sources), atol=1e-6)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_stacked_and_one_by_one_mixes_agree(dtype, tol):
    """Small sources are mixed stacked (a few batched ops), large ones one at a time: the same mix."""
    torch.manual_seed(0)
    layer = BlockAttnRes(16).to(dtype)
    with torch.no_grad():
        layer.proj.weight.normal_()
    sources = [torch.randn(2, 3, 16, dtype=dtype) * s for s in (1.0, 2.0, 0.5, 4.0)]
    values = [v.double() if dtype == torch.float64 else v.float() for v in sources]
    stacked = layer._mix_stacked(torch.stack(values))
    each = layer._mix_each(values)
    assert ((stacked - each).norm() / each.norm()).item() <= tol
    torch.testing.assert_close(layer(sources), stacked.to(dtype))


def test_one_by_one_mix_gradients_equal_the_formulas():
    """The one-by-one mix is an autograd function with a hand-derived backward: its gradients (sources,
    norm and proj weights) equal autograd through the direct formula, and gradcheck passes."""
    torch.manual_seed(0)
    layer = BlockAttnRes(7).double()
    with torch.no_grad():
        layer.norm.weight.uniform_(0.5, 1.5)
        layer.proj.weight.normal_()
    sources = [(torch.randn(2, 5, 7, dtype=torch.float64) * s).requires_grad_() for s in (1.0, 3.0, 0.2)]
    params = [*sources, layer.norm.weight, layer.proj.weight]
    out = layer._mix_each(sources)
    seed = torch.randn_like(out)
    got = torch.autograd.grad((out * seed).sum(), params)
    want = torch.autograd.grad(
        (direct(sources[:-1], sources[-1], layer.norm.weight, layer.proj.weight) * seed).sum(), params
    )
    for g, w in zip(got, want):
        assert ((g - w).norm() / w.norm()).item() <= 1e-12
    assert torch.autograd.gradcheck(lambda *vs: layer._mix_each(list(vs)), sources[:2])
    one = [torch.randn(4, 7, dtype=torch.float64, requires_grad=True)]  # a single source: the mix is itself
    (g,) = torch.autograd.grad(layer._mix_each(one).sum(), one)
    torch.testing.assert_close(g, torch.ones_like(g))
