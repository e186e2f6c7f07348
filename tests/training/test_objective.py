"""The LM head and cross-entropy in pieces (k3.models.loss.head_cross_entropy, CausalLM.forward with
targets) against the whole logits' F.cross_entropy: the loss and every parameter's gradient, untied and
tied heads, float32 and float64, pieces that do not divide the tokens; validation's summed loss both ways."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3.models import CausalLM, get_config
from k3.models.loss import IGNORE_INDEX, head_cross_entropy
from k3.training.objective import next_token_loss, summed_loss


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def tiny(preset: str, dtype: torch.dtype) -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(get_config(preset, vocab_size=97, hidden_size=32, num_layers=2)).to(dtype)


# float32: rounding (measured: loss 1e-7, gradients 6e-7 relative); float64: 1e-10 (measured 1e-15)
@pytest.mark.parametrize("dtype, rtol, grad_rtol", [(torch.float32, 1e-6, 5e-6), (torch.float64, 1e-10, 1e-10)])
@pytest.mark.parametrize("preset", ["kimi-k3-tiny", "gpt2-tiny"])  # untied head; head tied to the embedding
def test_pieces_give_the_whole_logits_loss_and_gradients(preset, dtype, rtol, grad_rtol):
    model = tiny(preset, dtype)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (preset == "gpt2-tiny")
    windows = torch.randint(0, 97, (3, 22), generator=torch.Generator().manual_seed(1))
    losses, grads = {}, {}
    for pieces in (False, True):
        model.zero_grad(set_to_none=True)
        if pieces:
            loss = next_token_loss(model, windows)
        else:
            logits = model(windows[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, 97), windows[:, 1:].reshape(-1))
        loss.backward()
        losses[pieces] = loss.detach()
        grads[pieces] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert losses[True].dtype == losses[False].dtype == dtype
    assert abs(losses[True] - losses[False]) <= rtol * losses[False]
    head = "model.embed_tokens.weight" if preset == "gpt2-tiny" else "lm_head.weight"  # (a tied head is named once)
    assert grads[True].keys() == grads[False].keys() and head in grads[True]
    for name, g in grads[False].items():
        assert (grads[True][name] - g).norm() <= grad_rtol * g.norm(), name  # (zero where AttnRes starts uniform)


@pytest.mark.parametrize("tokens_per_piece", [1, 5, 8, 64])
def test_head_cross_entropy_any_piece_size(tokens_per_piece):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(21, 16, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(8, 16, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 8, (21,), generator=g)
    for reduction in ("mean", "sum"):
        got = head_cross_entropy(hidden, weight, targets, reduction, piece=8 * tokens_per_piece)
        want = F.cross_entropy(hidden @ weight.t(), targets, reduction=reduction)
        assert abs(got - want) <= 1e-12 * want
        grad_out = torch.tensor(0.7, dtype=torch.float64)  # the incoming gradient scales what forward formed
        got_grads = torch.autograd.grad(got, (hidden, weight), grad_out)
        want_grads = torch.autograd.grad(want, (hidden, weight), grad_out)
        for a, b in zip(got_grads, want_grads):
            assert rel(a, b) <= 1e-12


def test_head_cross_entropy_bfloat16_and_large_logits():
    g = torch.Generator().manual_seed(0)
    hidden = (30 * torch.randn(40, 16, generator=g)).bfloat16().requires_grad_()  # logits in the hundreds
    weight = torch.randn(50, 16, generator=g).bfloat16().requires_grad_()
    targets = torch.randint(0, 50, (40,), generator=g)
    loss = head_cross_entropy(hidden, weight, targets, piece=50 * 7)
    dh, dw = torch.autograd.grad(loss, (hidden, weight))
    assert loss.dtype == torch.float32 and dh.dtype == dw.dtype == torch.bfloat16
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    want = F.cross_entropy(h64 @ w64.t(), targets)
    assert torch.isfinite(loss) and abs(loss.double() - want) <= 1e-5 * want
    for a, b in zip((dh, dw), torch.autograd.grad(want, (h64, w64))):
        assert rel(a.double(), b) <= 1e-2


def test_without_gradients_nothing_is_formed_and_no_graph():
    model = tiny("kimi-k3-tiny", torch.float32)
    windows = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        loss = next_token_loss(model, windows)
    assert not loss.requires_grad
    with pytest.raises(ValueError, match="reduction"):
        head_cross_entropy(torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(2, dtype=torch.long), "none")


def test_validation_sum_is_the_same_in_pieces():
    class Data:
        token_bytes = torch.ones(97, dtype=torch.long)

    model = tiny("kimi-k3-tiny", torch.float64)
    windows = torch.randint(0, 97, (5, 13), generator=torch.Generator().manual_seed(3))
    counted = torch.tensor([True, False, True, True, False])
    with torch.no_grad():
        logits = model(windows[:, :-1])
    for keep in (torch.ones(5, dtype=torch.bool), counted):
        want = F.cross_entropy(logits[keep].reshape(-1, 97), windows[keep, 1:].reshape(-1), reduction="sum")
        nats, nbytes = summed_loss(model, Data(), windows, batch_size=2, counted=keep)
        assert nbytes == int(keep.sum()) * 12 and abs(nats - want) <= 1e-10 * want
    assert model.training  # the mode is given back


def test_ignored_targets_do_not_count_and_targets_are_checked():
    model = tiny("kimi-k3-tiny", torch.float64)
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(4))
    targets = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(5))
    ignored = targets.clone()
    ignored[1, 2:] = IGNORE_INDEX
    logits = model(ids)
    keep = ignored != IGNORE_INDEX
    want = F.cross_entropy(logits[keep], targets[keep])
    assert abs(model(ids, targets=ignored) - want) <= 1e-12 * want
    assert abs(model(ids, targets=ignored, reduction="sum") - want * keep.sum()) <= 1e-12 * want * keep.sum()
    with pytest.raises(ValueError, match="targets"):
        model(ids, targets=targets[:, :3])
    with pytest.raises(ValueError, match="without a cache"):
        model(ids, cache=model.new_cache(2), targets=targets)
