"""MLA: absorbed decode == plain path; prefill-then-decode == one forward; the cache holds only latents."""

from __future__ import annotations

import pytest
import torch

from k3.layers.mla import MultiHeadLatentAttention
from k3.models.kinds import layer_cache

from .helpers import prefill_then_decode_error, run

CONFIGS = {
    "kimi-linear": dict(q_lora_rank=None, output_gate=None, rope_theta=None),
    "k3": dict(q_lora_rank=12, output_gate="full", rope_theta=None),
    "rope": dict(q_lora_rank=12, output_gate="full", rope_theta=10000.0),
}


def make(name, dtype=torch.float32):
    torch.manual_seed(0)
    return MultiHeadLatentAttention(
        32, 4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, **CONFIGS[name]
    ).to(dtype)


@pytest.mark.parametrize("name", CONFIGS)
def test_absorbed_equals_plain(name):
    """With a cache of 17 tokens, decoding through the absorbed latents equals expanding kv_b (float64)."""
    layer = make(name, torch.float64)
    x = torch.randn(2, 18, 32, dtype=torch.float64)
    with torch.no_grad():
        cache_a, cache_b = layer_cache(layer, 2), layer_cache(layer, 2)
        run(layer, x[:, :17], cache_a)
        run(layer, x[:, :17], cache_b)
        absorbed = run(layer, x[:, 17:], cache_a, absorb=True)
        plain = run(layer, x[:, 17:], cache_b, absorb=False)
        full_absorbed = layer(x, absorb=True)  # also for a whole causal sequence
        full_plain = layer(x, absorb=False)
    torch.testing.assert_close(absorbed, plain, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(full_absorbed, full_plain, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("heads, dims", [(4, (16, 8, 4, 6)), (1, (7, 5, 2, 9))])
def test_absorbed_reads_each_row_at_its_own_position(T, heads, dims):
    """A fixed cache whose rows hold 10 and 6 tokens: the absorbed attention (one fused attention over the
    latents, masked past each row's position) equals the plain path and, for the shorter row, a cache of
    its 6 tokens alone (float64; H = 1 and odd sizes too)."""
    r, dn, dr, dv = dims
    torch.manual_seed(0)
    layer = MultiHeadLatentAttention(
        24,
        heads,
        q_lora_rank=12,
        kv_lora_rank=r,
        qk_nope_head_dim=dn,
        qk_rope_head_dim=dr,
        v_head_dim=dv,
        output_gate="full",
        rope_theta=10000.0,
    ).double()
    x = torch.randn(2, 10 + T, 24, dtype=torch.float64)
    outs = {}
    with torch.no_grad():
        for absorb in (True, False):
            cache = layer_cache(layer, 2, max_length=16)
            run(layer, x[:, :10], cache)
            cache.owner.lengths = [10, 6]
            cache.owner.positions.copy_(torch.tensor([10, 6]))
            outs[absorb] = run(layer, x[:, 10:], cache, absorb=absorb)
        alone = layer_cache(layer, 1)
        run(layer, x[1:, :6], alone)
        short = run(layer, x[1:, 10:], alone, absorb=False)
    torch.testing.assert_close(outs[True], outs[False], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(outs[True][1:], short, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_absorbed_decoding_in_low_precision_and_its_gradients(dtype, tol):
    """The absorbed path in float32 / bfloat16 against float64's plain one, and its gradients (float64)
    equal the plain path's."""
    layer = make("rope", torch.float64)
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    with torch.no_grad():
        want = layer(x, absorb=False)
        got = make("rope", dtype)(x.to(dtype), absorb=True)
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    grads = []
    for absorb in (True, False):
        layer.zero_grad()
        xg = x.clone().requires_grad_()
        layer(xg, absorb=absorb).square().sum().backward()
        grads.append([xg.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("prefix", [1, 5, 20])
def test_prefill_then_decode_equals_full_forward(name, prefix):
    layer = make(name)
    assert prefill_then_decode_error(layer, layer_cache(layer, 2), torch.randn(2, 24, 32), prefix) < 1e-5


def test_cache_holds_the_latent_size_per_slot():
    """(kv_lora_rank + qk_rope_head_dim) * bytes per slot per layer: 20 float32 values here."""
    layer = make("k3")
    cache = layer_cache(layer, 2)
    with torch.no_grad():
        run(layer, torch.randn(2, 5, 32), cache)
        run(layer, torch.randn(2, 1, 32), cache)
    assert cache.nbytes() == 2 * cache.owner.capacity * 20 * 4 and cache.owner.lengths == [6, 6]


def test_names_and_bad_input():
    names = {n for n, _ in make("k3").named_parameters()}
    assert {
        "q_a_proj.weight",
        "q_a_layernorm.weight",
        "q_b_proj.weight",
        "kv_a_proj_with_mqa.weight",
        "kv_a_layernorm.weight",
        "kv_b_proj.weight",
        "g_proj.weight",
        "o_proj.weight",
    } == names
    assert "q_proj.weight" in {n for n, _ in make("kimi-linear").named_parameters()}
    layer = make("k3")
    cache = layer_cache(layer, 2)
    with torch.no_grad():
        run(layer, torch.randn(2, 3, 32), cache)
    with pytest.raises(ValueError, match="batch size"):
        layer(torch.randn(1, 1, 32), cache=cache)
    with pytest.raises(ValueError, match="`x`"):
        layer(torch.randn(1, 1, 31))


def test_attention_probs_give_the_layers_output():
    """`attention_probs` (what k3 lab inspect plots) are the probabilities forward attends with: the value
    path rebuilt from them (o = W_uv (p . c), gated, o_proj) gives the layer's output; causal rows sum to 1."""
    torch.manual_seed(0)
    mla = MultiHeadLatentAttention(
        32, 2, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, output_gate="full"
    )
    x = torch.randn(1, 7, 32)
    probs = mla.attention_probs(x)
    _, c, _ = mla._queries_and_latents(x, 0)
    _, w_uv = mla._absorbed_weights()
    o = torch.einsum("bhts,bsr,hvr->bthv", probs, c, w_uv).reshape(1, 7, -1) * torch.sigmoid(mla.g_proj(x))
    assert torch.allclose(mla.o_proj(o), mla(x), atol=1e-5)
    assert torch.allclose(probs.sum(-1), torch.ones(1, 2, 7)) and probs[0, :, 0, 1:].abs().max() == 0  # causal


def test_a_short_piece_over_a_cache_runs_absorbed_and_equals_the_plain_path(monkeypatch):
    """`absorb_pays`: T (2 (r + dr) - (dn + dr + dv)) < (dn + dv) r. Here r 16, dr 4, dn 8, dv 6: T <= 10
    absorbs; at Kimi K3's sizes (r 512, dr 64, dn = dv = 128) T <= 157. By default a cached call of 4
    tokens runs absorbed and one of 11 plain, and each equals the other path (float64)."""
    layer = make("k3", torch.float64)
    assert [layer.absorb_pays(T) for T in (1, 10, 11)] == [True, True, False]
    k3 = MultiHeadLatentAttention(
        64, 2, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
    )
    assert k3.absorb_pays(157) and not k3.absorb_pays(158)
    ran = []
    for path in ("_absorbed", "_plain"):
        method = getattr(MultiHeadLatentAttention, path)
        monkeypatch.setattr(
            MultiHeadLatentAttention, path, lambda self, *a, m=method, p=path: ran.append(p) or m(self, *a)
        )
    x = torch.randn(2, 30, 32, dtype=torch.float64)
    with torch.no_grad():
        for T, default in ((4, "_absorbed"), (11, "_plain")):
            outs = {}
            for absorb in (None, True, False):
                cache = layer_cache(layer, 2)
                run(layer, x[:, :17], cache, absorb=False)
                ran.clear()
                outs[absorb] = run(layer, x[:, 17 : 17 + T], cache, absorb=absorb)
                if absorb is None:
                    assert ran == [default]
            torch.testing.assert_close(outs[True], outs[False], rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(outs[None], outs[default == "_absorbed"], rtol=0, atol=0)
