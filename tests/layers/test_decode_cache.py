"""The decode-time pieces of the layers: a layer's cache (writes at each row's position, the slots read) and
the short convolution's rolling window."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3.layers.conv import ShortConvolution, joint_step, rolling_step
from k3.layers.mla import MultiHeadLatentAttention
from k3.models.kinds import layer_cache


def test_a_layer_cache_writes_each_row_at_its_position_and_reads_the_slots_held():
    """One layer's cache (`k3.models.kinds.layer_cache`): T tokens go to slots positions[b] ... + T - 1 of
    each row, in place; attention reads the slots up to the longest row's end; one token into a cache of
    fixed slots reads them all (shapes that never change), masked past each row's position."""
    layer = MultiHeadLatentAttention(
        32, 2, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8
    )
    for max_length in (None, 16):
        cache = layer_cache(layer, 2, max_length)
        owner, buffer = cache.owner, cache.latents  # [c | k_pe] per slot
        latents = torch.randn(2, 3, 8 + 4)
        (read,) = cache.append(latents=latents)
        assert read.shape == (2, 3, 12) and torch.equal(read, latents)
        assert cache.latents.data_ptr() == buffer.data_ptr()
        owner.advance(3)
        one = torch.randn(2, 1, 12)
        (read,) = cache.append(latents=one)
        assert read.shape[1] == (16 if max_length else 4) and torch.equal(read[:, 3], one[:, 0])
        mask = cache.visible(1, read.shape[1])
        assert (mask is None) == (max_length is None)  # every row at one position, the slots held read
        if mask is not None:
            assert mask[:, 0, 0].sum(-1).tolist() == [4, 4]


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
