"""Activation recompute (`k3 train --recompute full|selective`, k3.training.parallel.apply_recompute): the
same losses and gradients as without it, fewer activations kept for the backward pass."""

from __future__ import annotations

import copy

import pytest
import torch

from k3.models import CausalLM, get_config
from k3.training import TrainConfig, train
from k3.training.parallel import apply_recompute

from ..corpus import write_corpus


def model(dtype=torch.float64) -> CausalLM:
    torch.manual_seed(0)  # KDA, MLA, MoE, Block AttnRes; 5 layers, odd width
    return CausalLM(get_config("kimi-k3-tiny", vocab_size=300, hidden_size=36, num_layers=5)).to(dtype)


def loss_and_grads(net: CausalLM, mode: str, ids, targets):
    net = copy.deepcopy(net)
    apply_recompute(net, mode)
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = net(ids, targets=targets)
    kept = sum(saved)  # bytes kept for the backward pass by the forward (recomputed ones come later)
    loss.backward()
    grads = {n: p.grad for n, p in net.named_parameters() if p.grad is not None}
    return loss, grads, [m.last_load for m in net.moe_layers()], kept


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_recompute_gives_the_same_loss_and_gradients_and_keeps_less(dtype, tol):
    g = torch.Generator().manual_seed(1)
    ids, targets = torch.randint(0, 300, (2, 37), generator=g), torch.randint(0, 300, (2, 37), generator=g)
    base = model(dtype)
    loss, grads, loads, kept = loss_and_grads(base, "none", ids, targets)
    sizes = {"none": kept}
    for mode in ("full", "selective"):
        other, other_grads, other_loads, sizes[mode] = loss_and_grads(base, mode, ids, targets)
        assert torch.allclose(other, loss, rtol=tol, atol=0)
        assert other_grads.keys() == grads.keys()
        for name, grad in grads.items():
            assert torch.allclose(other_grads[name], grad, rtol=tol, atol=tol * grad.abs().max()), (mode, name)
        assert all(torch.equal(a, b) for a, b in zip(other_loads, loads))  # the bias update sees the same load
    assert sizes["full"] < sizes["selective"] < sizes["none"]
    assert sizes["full"] < 0.3 * sizes["none"]


def test_parameter_names_are_unchanged_and_bad_modes_refused():
    net = model()
    names = [n for n, _ in net.named_parameters()]
    apply_recompute(net, "full")
    assert [n for n, _ in net.named_parameters()] == names and list(net.state_dict()) == list(model().state_dict())
    with pytest.raises(ValueError, match="recompute must be one of none, full, selective, got 'some'"):
        apply_recompute(model(), "some")
    with pytest.raises(ValueError, match="`recompute` must be one of 'none', 'full', 'selective', got 'all'"):
        TrainConfig(recompute="all")


def test_training_with_recompute_takes_the_same_steps_and_resumes_without_it(tmp_path):
    (tmp_path / "corpus").mkdir()
    corpus = write_corpus(tmp_path / "corpus", docs=4, words=300)
    base = dict(
        preset="kimi-k3-tiny",
        model_overrides={"hidden_size": 32, "num_layers": 3},
        data=str(corpus),
        tokenizer="byte",
        seq_len=16,
        batch_size=2,
        max_steps=4,
        eval_every=2,
        eval_tokens=64,
        final_eval_tokens=64,
        val_fraction=0.2,
        threads=1,
        device="cpu",
    )
    plain = train(TrainConfig(**base, out=str(tmp_path / "plain")), progress=False)
    half = train(TrainConfig(**{**base, "max_steps": 2}, out=str(tmp_path / "full"), recompute="full"), progress=False)
    assert half["loss"] == pytest.approx(plain["loss"][:2], rel=1e-5)
    resumed = train(
        TrainConfig(max_steps=4, recompute="selective"),
        resume=str(tmp_path / "full"),
        asked=("max_steps", "recompute"),
        progress=False,
    )  # recompute changes no arithmetic
    assert resumed["loss"] == pytest.approx(plain["loss"], rel=1e-5)
