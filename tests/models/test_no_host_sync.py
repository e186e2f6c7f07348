"""A model's forward reads nothing back from the device, so it compiles whole and never stalls a GPU stream.

Two proofs per tiny preset: a spy on the Tensor methods that read values back to the host (`item`,
`tolist`, `__bool__`, `nonzero`, `__int__`, `__float__`, `__index__`; all but KDA's read of its gate's
bound from host memory, which a GPU tensor or a compiled graph never makes) over a training forward + backward,
a prefill + decode through a growing cache and through a static one; and `torch.compile(fullgraph=True)`
(the "aot_eager" backend: graphs captured, no code generated, seconds) of the training forward + backward
and of a decode step over a static cache, each equal to eager.
"""

from __future__ import annotations

import collections
import traceback

import pytest
import torch

from k3.models import CausalLM, get_config

PRESETS = [
    "gpt2-tiny",
    "linear-attn-tiny",
    "deltanet-tiny",
    "gated-deltanet-tiny",
    "kimi-linear-tiny",
    "kimi-k3-tiny",
    "kimi-k3-article-tiny",
]
READ_BACKS = ("item", "tolist", "__bool__", "nonzero", "__int__", "__float__", "__index__")
# The one read a forward makes, of host memory: KDA's gate takes its smallest step as the bound its blocks
# halve by when none is stated (k3.ops.numerics.halving_bound). A CPU tensor waits on no device, and a
# tensor elsewhere or a compiled graph never reads it (tests/ops/test_gates.py; the compiles below).
HOST_MEMORY_READS = {("item", "ops/numerics.py")}  # (method, the end of the file's path)


def model_of(name: str) -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(get_config(name)).double()


@pytest.fixture
def read_backs(monkeypatch):
    """Every read-back called from k3's code once the test sets `watching`: (method, file, line) -> count."""
    seen: collections.Counter = collections.Counter()
    seen.watching = False

    def spy(name, original):
        def method(self, *args, **kwargs):
            caller = traceback.extract_stack(limit=2)[0]
            if seen.watching and "/k3/" in caller.filename:
                seen[(name, "k3/" + caller.filename.split("/k3/")[-1], caller.lineno)] += 1
            return original(self, *args, **kwargs)

        return method

    for name in READ_BACKS:
        monkeypatch.setattr(torch.Tensor, name, spy(name, getattr(torch.Tensor, name)))
    return seen


@pytest.mark.parametrize("name", PRESETS)
def test_a_forward_reads_nothing_back(name, read_backs):
    model = model_of(name)
    ids = torch.randint(0, model.config.vocab_size, (2, 37))
    caches = (model.new_cache(2), model.new_cache(2, max_length=64))
    read_backs.watching = True
    model(ids, targets=ids).backward()
    with torch.no_grad():
        for cache in caches:
            model(ids, cache)
            model(ids[:, :1], cache)
    allowed = lambda read: any(read[0] == name and read[1].endswith(end) for name, end in HOST_MEMORY_READS)  # noqa: E731
    assert [read for read in read_backs if not allowed(read)] == []


@pytest.mark.slow  # about 100 s for the seven presets (make test-slow, CI)
@pytest.mark.parametrize("name", PRESETS)
def test_the_training_forward_and_backward_compile_whole(name):
    torch._dynamo.reset()
    model = model_of(name)
    ids = torch.randint(0, model.config.vocab_size, (2, 37))
    loss = torch.compile(lambda ids: model(ids, targets=ids), fullgraph=True, backend="aot_eager")(ids)
    loss.backward()
    compiled = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    eager = model(ids, targets=ids)
    eager.backward()
    torch.testing.assert_close(loss, eager, rtol=1e-12, atol=1e-12)
    for got, want in zip(compiled, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", PRESETS)
@torch.no_grad()
def test_a_decode_step_compiles_whole(name):
    torch._dynamo.reset()
    model = model_of(name)
    ids = torch.randint(0, model.config.vocab_size, (2, 37))
    caches = [model.new_cache(2, max_length=64) for _ in range(2)]
    for cache in caches:
        model(ids, cache)
    step = torch.compile(lambda tokens, cache: model(tokens, cache), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(step(ids[:, -1:], caches[0]), model(ids[:, -1:], caches[1]), rtol=1e-12, atol=1e-12)
