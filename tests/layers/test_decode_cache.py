"""The decode-time pieces of the layers: the growing KV / latent cache buffers (amortised growth, the
rows held, adoption of given tensors, gradients) and the short convolution's rolling window."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3.layers.attention import KVCache
from k3.layers.conv import ShortConvolution, joint_step, rolling_step
from k3.layers.mla import LatentCache


def test_appends_grow_the_buffer_geometrically_and_keep_every_row():
    cache = KVCache()
    assert cache.batch_size is None and cache.length == 0 and cache.capacity == 0 and cache.k is None
    rows_k, rows_v, buffers = [], [], set()
    for t in range(40):
        k, v = torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 5)
        rows_k.append(k)
        rows_v.append(v)
        k_all, v_all = cache.append(k=k, v=v)
        assert torch.equal(k_all, torch.cat(rows_k, 1)) and torch.equal(v_all, torch.cat(rows_v, 1))
        buffers.add(cache._rows["k"][0].data_ptr())
    assert cache.length == 40 and cache.k.shape == (2, 40, 3, 4) and cache.batch_size == 2
    assert 40 <= cache.capacity <= 64
    assert len(buffers) <= 7  # 1, 2, 4, ..., 64: a new buffer only when the old one is full
    assert cache.nbytes() == 2 * 40 * 3 * (4 + 5) * 4 <= cache.allocated_bytes()


def test_assigned_tensors_are_adopted_and_growth_starts_from_them():
    c, k_pe = torch.randn(1, 6, 8), torch.randn(1, 6, 2)
    cache = LatentCache(c=c, k_pe=k_pe)
    assert cache.length == 6 and cache.c is c  # a full buffer is read as it is
    cache.append(c=torch.ones(1, 1, 8), k_pe=torch.ones(1, 1, 2))
    assert cache.length == 7 and torch.equal(cache.c[:, :6], c) and torch.equal(cache.c[:, 6], torch.ones(1, 8))
    cache.c, cache.k_pe = cache.c[:, :3], cache.k_pe[:, :3]  # reordered / cut by the caller
    assert cache.length == 3
    with pytest.raises(TypeError, match="unknown fields"):
        LatentCache(kv=c)


def test_appends_under_autograd_keep_the_gradient_path():
    """While gradients are recorded, an append concatenates (no earlier tensor is overwritten in place)."""
    cache = KVCache()
    k1 = torch.randn(1, 2, 1, 3, requires_grad=True)
    cache.append(k=k1, v=k1 * 2)
    k2 = torch.randn(1, 1, 1, 3, requires_grad=True)
    k_all, v_all = cache.append(k=k2, v=k2 * 2)
    (k_all.sum() + v_all.sum()).backward()
    assert torch.equal(k1.grad, torch.full_like(k1, 3.0)) and torch.equal(k2.grad, torch.full_like(k2, 3.0))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rolling_window_step_equals_the_convolution(dtype):
    torch.manual_seed(0)
    conv = ShortConvolution(6, kernel_size=4).to(dtype)
    x = torch.randn(2, 9, 6, dtype=dtype)
    full, _ = conv(x)
    _, state = conv(x[:, :5], output_final_state=True)
    outs = []
    for t in range(5, 9):  # one token at a time: the rolling window
        y, state = conv.step(x[:, t], state)
        outs.append(y)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(torch.stack(outs, 1), full[:, 5:], rtol=tol, atol=tol)
    _, want_state = conv(x, output_final_state=True)
    torch.testing.assert_close(state, want_state, rtol=0, atol=0)  # the last inputs, copied exactly
    # a T = 1 call with a state takes the same path through forward
    y1, s1 = conv(x[:, 8:9], conv_state=conv(x[:, :8], output_final_state=True)[1], output_final_state=True)
    torch.testing.assert_close(y1[:, 0], full[:, 8], rtol=tol, atol=tol)


def test_joint_step_is_each_convolution_side_by_side():
    torch.manual_seed(1)
    convs = [ShortConvolution(d, kernel_size=4).double() for d in (3, 5, 2)]
    xs = [torch.randn(2, c.dim, dtype=torch.float64) for c in convs]
    states = [torch.randn(2, c.dim, 3, dtype=torch.float64) for c in convs]
    y, new_states = joint_step(convs, xs, states)
    at = 0
    for conv, x, s, ns in zip(convs, xs, states, new_states):
        want_y, want_s = rolling_step(x, s, conv.weight, conv.activation)
        want_conv = F.silu(F.conv1d(torch.cat([s, x[..., None]], -1), conv.weight, groups=conv.dim))[..., 0]
        torch.testing.assert_close(y[:, at : at + conv.dim], want_y, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(want_y, want_conv, rtol=1e-12, atol=1e-12)
        assert torch.equal(ns, want_s)
        at += conv.dim
