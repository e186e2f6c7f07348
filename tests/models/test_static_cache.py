"""The cache (`new_cache(batch_size, max_length=N)`: slots allocated once; without max_length: grown):
prefill + decode equals one full forward for every tiny preset (float64, 1e-10), rows at different
positions compute what they would alone, caches join (`concat`) and rows leave (`reorder`), a fixed
cache's buffers keep their addresses, a growing one doubles, and bad sizes fail clearly."""

from __future__ import annotations

import pytest
import torch

from k3.models import Cache

from .conftest import TINY, tiny_model


def _ids(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 512, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name, overrides", [(name, {}) for name in TINY] + [("kimi-k3-tiny", {"rope_theta": 1e4})])
def test_prefill_then_decode_equals_full_forward(name, overrides):
    model = tiny_model(name, **overrides).double()
    ids = _ids(2, 40)
    with torch.no_grad():
        full = model(ids)
        for t in (1, 7, 33):  # a one-token prefill, one shorter than a chunk, one longer
            cache = model.new_cache(2, max_length=48)
            assert isinstance(cache, Cache) and cache.max_length == 48
            steps = [model(ids[:, :t], cache=cache)]
            steps += [model(ids[:, s : s + 1], cache=cache) for s in range(t, t + 5)]
            torch.testing.assert_close(torch.cat(steps, 1), full[:, : t + 5], rtol=1e-10, atol=1e-10)
            assert cache.length == t + 5 and cache.positions.tolist() == [t + 5] * 2


def test_prefill_in_pieces_and_the_decode_step_keep_the_buffers():
    """Two prefills and decode steps write into the same tensors (what a captured graph replays over)."""
    model = tiny_model("kimi-k3-tiny").double()
    ids = _ids(3, 30)
    cache = model.new_cache(3, max_length=32)
    pointers = [t.data_ptr() for layer in cache.layers for t in layer.buffers()] + [cache.positions.data_ptr()]
    with torch.no_grad():
        got = torch.cat(
            [model(ids[:, :11], cache=cache), model(ids[:, 11:25], cache=cache)]
            + [model(ids[:, s : s + 1], cache=cache) for s in range(25, 30)],
            1,
        )
        torch.testing.assert_close(got, model(ids), rtol=1e-10, atol=1e-10)
    assert [t.data_ptr() for layer in cache.layers for t in layer.buffers()] + [cache.positions.data_ptr()] == pointers


@pytest.mark.parametrize("name", ["kimi-k3-tiny", "gpt2-tiny", "kimi-linear-tiny"])
def test_rows_of_different_lengths_joined_then_decode_equal_each_alone(name):
    """Caches prefilled apart join as one of fixed slots (each row at its own position); each row decodes as alone."""
    model = tiny_model(name).double()
    lengths = [4, 9, 1]
    rows = [_ids(1, n, seed=n) for n in lengths]
    caches = [model.new_cache(1) for _ in rows]
    with torch.no_grad():
        for ids, c in zip(rows, caches):
            model(ids, cache=c)
        static = Cache.concat(caches, max_length=16)
        assert static.positions.tolist() == lengths and static.length == 9
        step = torch.tensor([[5], [6], [7]])
        for _ in range(3):
            together = model(step, cache=static)
            for i, c in enumerate(caches):
                torch.testing.assert_close(together[i], model(step[i : i + 1], cache=c)[0], rtol=1e-10, atol=1e-10)
        # a prefill of T > 1 tokens with the rows at different positions (each takes T after its own)
        more = _ids(3, 4, seed=5)
        together = model(more, cache=static)
        for i, c in enumerate(caches):
            torch.testing.assert_close(together[i], model(more[i : i + 1], cache=c)[0], rtol=1e-10, atol=1e-10)
    assert static.positions.tolist() == [n + 7 for n in lengths]


def test_capacity_and_arguments_fail_clearly():
    model = tiny_model("kimi-k3-tiny")
    cache = model.new_cache(1, max_length=8)
    with torch.no_grad():
        model(_ids(1, 6), cache=cache)
        with pytest.raises(ValueError, match=r"3 more token\(s\) after 6 would pass `max_length` 8"):
            model(_ids(1, 3), cache=cache)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="`max_length` must be a positive int"):
            model.new_cache(1, max_length=bad)
    with pytest.raises(ValueError, match="more than the 1024 positions"):
        tiny_model("gpt2-tiny").new_cache(1, max_length=2048)
    with pytest.raises(ValueError, match="do not fit max_length 4"):
        Cache.concat([cache], max_length=4)


def test_reset_and_memory():
    model = tiny_model("kimi-k3-tiny")
    cache = model.new_cache(2, max_length=16)
    c = model.config
    mla = c.layer_types.count("mla") * 2 * 16 * (c.kv_lora_rank + c.qk_rope_head_dim) * 4
    assert cache.nbytes_by_type()["mla"] == mla  # all slots, allocated up front
    with torch.no_grad():
        first = model(_ids(2, 5), cache=cache)
        cache.reset()
        assert cache.length == 0 and not any(bool(t.any()) for layer in cache.layers for t in layer.buffers())
        torch.testing.assert_close(model(_ids(2, 5), cache=cache), first, rtol=0, atol=0)
    assert all(bool(layer.storage) == (kind == "mla") for layer, kind in zip(cache.layers, c.layer_types))


@pytest.mark.parametrize("name", ["kimi-k3-tiny", "gpt2-tiny"])
def test_a_growing_cache_doubles_and_rows_leave(name):
    """Without max_length the slots double as the rows grow (what they held kept); `reorder` keeps some rows
    (repeats allowed) and shrinks the slots to the longest of them; each row decodes as it would alone."""
    model = tiny_model(name).double()
    ids = _ids(3, 150)
    cache = model.new_cache(3)
    start = cache.capacity
    with torch.no_grad():
        full = model(ids)
        got = [model(ids[:, : start - 1], cache=cache)] + [
            model(ids[:, s : s + 1], cache=cache) for s in range(start - 1, 150)
        ]
        torch.testing.assert_close(torch.cat(got, 1), full, rtol=1e-10, atol=1e-10)
        assert cache.capacity >= 150 > start and cache.lengths == [150] * 3
        cache.reorder(torch.tensor([2, 0, 0]))
        more = _ids(3, 2, seed=3)
        together = model(more, cache=cache)
        for row, i in enumerate([2, 0, 0]):
            alone = model(torch.cat([ids[i : i + 1], more[row : row + 1]], 1))[:, -2:]
            torch.testing.assert_close(together[row], alone[0], rtol=1e-10, atol=1e-10)
