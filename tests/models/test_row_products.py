"""k3.inference.row_products: inside `RowProducts`, F.linear and torch.bmm with a few rows are reductions
equal to the GEMM's result (float64: to the last bits; through dynamo too), and larger products are left
to the GEMM; the compiled decode step on the CPU uses the mode, the eager one does not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3.inference.row_products import ROWS, RowProducts
from k3.models import CausalLM, get_config


@pytest.mark.parametrize("shape", [(7,), (1, 7), (2, 1, 7), (ROWS, 7), (1, ROWS, 7)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_with_few_rows_is_the_same_product(shape, bias):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(5, 7, generator=g, dtype=torch.float64)
    b = torch.randn(5, generator=g, dtype=torch.float64) if bias else None
    with RowProducts():
        got = F.linear(x, w, b)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-12, atol=1e-12)


def test_bmm_with_few_rows_is_the_same_product_and_through_dynamo():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(3, 2, 6, generator=g, dtype=torch.float64), torch.randn(3, 9, 6, generator=g).double()

    def f(a, b):
        with RowProducts():
            return torch.bmm(a, b.transpose(1, 2)), torch.nn.functional.linear(a[0], b[0])

    want = (torch.bmm(a, b.transpose(1, 2)), F.linear(a[0], b[0]))
    for fn in (f, torch.compile(f, backend="aot_eager", fullgraph=True)):
        for got, expected in zip(fn(a, b), want):
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_more_rows_are_left_to_the_gemm(monkeypatch):
    import k3.inference.row_products as rp

    calls = []
    monkeypatch.setattr(rp, "linear_rows", lambda *a: calls.append(a) or F.linear(*a))
    x, w = torch.randn(ROWS + 1, 4), torch.randn(3, 4)
    with RowProducts():
        F.linear(x, w)
        assert not calls
        F.linear(x[:ROWS], w)
    assert len(calls) == 1


def test_the_compiled_cpu_step_uses_the_mode_and_the_eager_one_does_not():
    model = CausalLM(get_config("kimi-k3-tiny")).eval()
    eager = model.decode_step(model.new_cache(1, max_length=16))
    compiled = model.decode_step(model.new_cache(1, max_length=16), compile="aot_eager")
    assert compiled._row_products and not eager._row_products
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), cache=eager.cache)
        model(torch.tensor([[1, 2, 3]]), cache=compiled.cache)
    tokens = torch.tensor([3])
    for _ in range(4):
        a, b = eager(tokens), compiled(tokens)
        torch.testing.assert_close(compiled.last_logits, eager.last_logits, rtol=1e-4, atol=1e-5)
        top2 = eager.last_logits.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 1e-3  # the same token wherever rounding cannot decide it
        assert torch.equal(a[clear], b[clear])
        tokens = a
