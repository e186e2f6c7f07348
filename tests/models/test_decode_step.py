"""The decode step over a static cache (k3.inference.decode_step): one graph for every tiny preset (torch.compile
fullgraph with the cheap "aot_eager" backend), logits equal to eager, no recompile per token or per prompt
length; the MoE's gathered experts; sampling inside the step; generate/stream(compile=...); the C++
compiler check."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from k3 import runtime
from k3.inference.decode_step import DecodeStep
from k3.inference.generation import sample_with_noise, sampling_probs, static_length

from .conftest import TINY, tiny_model


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _ids(B: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, (B, T), generator=torch.Generator().manual_seed(seed))


def _prefilled(model, ids: torch.Tensor, max_length: int = 32):
    cache = model.new_cache(ids.shape[0], max_length=max_length)
    with torch.no_grad():
        model(ids, cache=cache)
    return cache


@pytest.mark.parametrize("name", TINY)
def test_one_graph_logits_equal_eager_no_recompile(name):
    model = tiny_model(name)
    ids = _ids(2, 9)
    eager = DecodeStep(model, _prefilled(model, ids))
    counter = CompileCounterWithBackend("aot_eager")
    compiled = DecodeStep(model, _prefilled(model, ids), compile=counter)  # fullgraph: a break would raise
    a = b = ids[:, -1]
    for _ in range(4):
        a, b = eager(a), compiled(b)
        torch.testing.assert_close(compiled.last_logits, eager.last_logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(a, b)
    # another prompt length (same cache size) in a new cache: the same graph
    other = DecodeStep(model, _prefilled(model, _ids(2, 14, seed=1)), compile=counter)
    other(_ids(2, 14, seed=1)[:, -1])
    other(other(_ids(2, 1)[:, 0]))
    assert counter.frame_count == 1, f"{name}: compiled {counter.frame_count} graphs"


def test_step_equals_full_forward_float64():
    model = tiny_model("kimi-k3-tiny").double()
    ids = _ids(3, 20)
    cache = _prefilled(model, ids[:, :12])
    step = DecodeStep(model, cache, compile=CompileCounterWithBackend("aot_eager"))
    with torch.no_grad():
        full = model(ids)
    for t in range(12, 20):
        step(ids[:, t])
        torch.testing.assert_close(step.last_logits, full[:, t], rtol=1e-10, atol=1e-10)
    assert cache.length == 20 and cache.positions.tolist() == [20] * 3


def test_static_addresses_for_cuda_graphs_keep_the_step_exact():
    """What the CUDA path marks (every buffer, input, stack and joined weight the step reads besides the
    parameters) is found and marked; the step still equals eager (run here on the CPU)."""
    model = tiny_model("kimi-k3-tiny")
    ids = _ids(2, 9)
    eager = DecodeStep(model, _prefilled(model, ids))
    compiled = DecodeStep(
        model, _prefilled(model, ids), temperature=0.5, compile=CompileCounterWithBackend("aot_eager")
    )
    marked = []
    original = torch._dynamo.mark_static_address
    torch._dynamo.mark_static_address = lambda t: marked.append(t) or original(t)
    try:
        compiled._mark_static_addresses()
    finally:
        torch._dynamo.mark_static_address = original
    cache = compiled.cache
    kinds = model.config.layer_types
    expected = kinds.count("mla") + 2 * kinds.count("kda") + 4  # + positions, tokens, sources, noise
    joined = [m for m in model.modules() if hasattr(m, "fuse_for_decoding") and len(m._input_projections()) > 1]
    expected += 3 * len(model.moe_layers()) + len(joined)
    assert len(marked) == expected and {id(t) for t in (cache.positions, compiled._tokens)} <= {id(t) for t in marked}
    assert all(t._base is None for t in marked)  # the buffers themselves, not views of them
    compiled.temperature = 0.0  # greedy from here: equal to eager
    a = b = ids[:, -1]
    for _ in range(2):
        a, b = eager(a), compiled(b)
        torch.testing.assert_close(compiled.last_logits, eager.last_logits, rtol=1e-5, atol=1e-5)


def test_step_checks_its_input_and_room():
    model = tiny_model("kimi-k3-tiny")
    cache = _prefilled(model, _ids(2, 7), max_length=8)
    step = DecodeStep(model, cache)
    with pytest.raises(ValueError, match=r"`tokens` must be \[2\]"):
        step(torch.tensor([1, 2, 3]))
    step(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="would pass `max_length` 8"):
        step(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="must be a static cache"):
        DecodeStep(model, model.new_cache(2))


def test_moe_gathered_experts_equal_the_slots_and_are_made_with_the_step():
    """The copies a step makes (`prepare_for_decoding`) are the weights as they were then; given to the MoE
    (`fused`), they select the gathered path, which equals the slots' path on the layer's own weights."""
    model = tiny_model("kimi-k3-tiny")
    moe = model.moe_layers()[0]
    index = next(i for i, layer in enumerate(model.model.layers) if layer.ffn is moe)
    x = torch.randn(3, model.config.hidden_size)
    with torch.no_grad():
        fused = DecodeStep(model, model.new_cache(1, max_length=8)).fused[index][1]
        torch.testing.assert_close(moe(x, fused=fused), moe(x), rtol=1e-5, atol=1e-6)
        moe.experts[3].w1.mul_(2.0)  # an update after the step was made is not in its copies
        torch.testing.assert_close(fused.experts[0][3] * 2, moe.experts[3].w1)
        fused = DecodeStep(model, model.new_cache(1, max_length=8)).fused[index][1]
        torch.testing.assert_close(fused.experts[0][3], moe.experts[3].w1)
        torch.testing.assert_close(moe(x, fused=fused), moe(x.clone(), fused=fused), rtol=0, atol=0)
        torch.testing.assert_close(moe(x, fused=fused), moe(x), rtol=1e-5, atol=1e-6)


def test_copies_are_read_only_inside_a_step():
    """A model whose weights change in place (FSDP refills its parameters; p.data.copy_ bumps no version)
    computes with them as they are: the copies a step made are read only by that step."""
    model = tiny_model("kimi-k3-tiny")
    ids = _ids(1, 6)
    DecodeStep(model, model.new_cache(1, max_length=8))
    with torch.no_grad():
        for p in model.parameters():
            p.data.copy_(p.data * 0.5)
        cache = model.new_cache(1)
        model(ids[:, :5], cache=cache)
        step = model(ids[:, 5:], cache=cache)  # one token: the layers' decode paths
        torch.testing.assert_close(step[:, -1], model(ids)[:, -1], rtol=1e-4, atol=1e-5)


def test_moe_with_gradients_keeps_its_own_path():
    """Training (a gradient to take) never reads the stacked copy, which has no gradient."""
    model = tiny_model("kimi-k3-tiny").train()
    moe = model.moe_layers()[0]
    moe(torch.randn(2, model.config.hidden_size)).sum().backward()
    assert any(e.w1.grad is not None for e in moe.experts)


def test_sample_with_noise_draws_from_the_filtered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    g = torch.Generator().manual_seed(0)
    n = 40_000
    rows = logits.expand(n, -1)
    for top_k, top_p in ((None, None), (3, None), (None, 0.8), (4, 0.9)):
        noise = torch.empty(n, 6).exponential_(generator=g)
        tokens = sample_with_noise(rows, noise, 0.7, top_k, top_p)
        freq = torch.bincount(tokens, minlength=6).float() / n
        want = sampling_probs(logits, 0.7, top_k, top_p)[0]
        assert bool((freq[want == 0] == 0).all()), (top_k, top_p, freq)
        torch.testing.assert_close(freq, want, rtol=0, atol=0.012)
    assert torch.equal(sample_with_noise(rows[:5], None, 0.0), torch.zeros(5, dtype=torch.long))


@pytest.mark.parametrize("name", ["kimi-k3-tiny", "gpt2-tiny"])
def test_generate_compiled_greedy_equals_eager(name):
    model = tiny_model(name).double()
    ids = _ids(2, 6)
    want = model.generate(ids, 9, temperature=0)
    assert torch.equal(model.generate(ids, 9, temperature=0, compile="aot_eager"), want)
    batch = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
    for got, alone in zip(
        model.generate(batch, 8, temperature=0, compile="aot_eager"), model.generate(batch, 8, temperature=0)
    ):
        assert torch.equal(got, alone)
    g = torch.Generator().manual_seed(3)
    sampled = model.generate(batch, 8, temperature=0.9, top_k=50, top_p=0.95, generator=g, compile="aot_eager")
    assert [len(row) for row in sampled] == [11, 15, 9]


def test_stream_compiled_continues_a_static_cache_and_refuses_a_growing_one():
    model = tiny_model("kimi-k3-tiny").double()
    ids = _ids(1, 5)
    cache = model.new_cache(1, max_length=64)
    first = torch.stack(list(model.stream(ids, 4, temperature=0, cache=cache, compile="aot_eager")), 1)
    assert cache.length == 5 + 3
    turn = torch.cat([first[:, 3:], torch.tensor([[7, 8]])], 1)  # the last token yielded starts the next turn
    second = torch.stack(list(model.stream(turn, 3, temperature=0, cache=cache, compile="aot_eager")), 1)
    alone = model.generate(torch.cat([ids, first, turn[:, 1:]], 1), 3, temperature=0)
    assert torch.equal(second, alone[:, -3:])
    with pytest.raises(ValueError, match="decodes over a static cache"):
        list(model.stream(ids, 2, cache=model.new_cache(1), compile="aot_eager"))


def test_static_length_buckets():
    assert [static_length(n) for n in (1, 256, 257, 1000, 1025, 4096, 4097)] == [256, 256, 512, 1024, 2048, 4096, 5120]


def test_no_cxx_compiler_is_one_clear_line(monkeypatch):
    monkeypatch.setattr(runtime, "cxx_compiler", lambda: None)
    model = tiny_model("kimi-k3-tiny")
    with pytest.raises(ValueError, match="no C\\+\\+ compiler was found") as info:
        model.generate(_ids(1, 3), 2, compile=True)
    assert "\n" not in str(info.value)


def test_docs_example_runs(capsys):
    """docs/models.md's compiled decode example, with the cheap backend for compile=True (what it captures
    is the same graph; inductor's own run is the slow test in tests/test_generate_compile.py)."""
    from ..test_docs import python_block, run_block

    code = python_block("docs/models.md", "model.decode_step(cache")
    assert code.count("compile=True") == 2
    run_block(code.replace("compile=True", 'compile="aot_eager"'), "docs/models.md")
    assert capsys.readouterr().out.splitlines() == ["True", "[17, 17]"]
