"""Muon (k3.training.muon): Newton-Schulz orthogonalises, one step equals the formula on the matrices and
torch's AdamW elsewhere, the state dict round-trips, and build_optimizer splits a model as Moonlight does."""

import copy
import math

import pytest
import torch
from torch import nn

from k3.models import CausalLM, get_config
from k3.training import TrainConfig, build_optimizer
from k3.training.config import saved_train_config
from k3.training.muon import NS_COEFFICIENTS, Muon, muon_scale, newton_schulz
from k3.training.optim import no_decay


@pytest.mark.parametrize("shape", [(48, 80), (80, 48), (3, 17, 17), (4, 2, 31)])
def test_newton_schulz_keeps_the_singular_vectors_and_brings_the_values_near_one(shape):
    G = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    Y = newton_schulz(G)
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    D = U.mT @ Y @ Vh.mT  # diagonal when Y = U f(S) V^T
    off = D - torch.diag_embed(torch.diagonal(D, dim1=-2, dim2=-1))
    assert off.abs().max() < 1e-10
    s = torch.linalg.svdvals(Y)
    assert s.min() > 0.6 and s.max() < 1.2, (s.min(), s.max())


def test_newton_schulz_batched_equals_one_at_a_time():
    G = torch.randn(5, 12, 20, dtype=torch.float64)
    assert torch.allclose(newton_schulz(G), torch.stack([newton_schulz(g) for g in G]), rtol=0, atol=1e-12)


def _reference_ns(X: torch.Tensor, steps: int = 5) -> torch.Tensor:
    a, b, c = NS_COEFFICIENTS
    tall = X.shape[0] > X.shape[1]
    X = X.T if tall else X
    X = X / X.norm()
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 6)
        self.proj = nn.Linear(6, 5)
        self.up = nn.Linear(5, 9, bias=False)


def test_one_step_is_muon_on_the_matrices_and_adamw_elsewhere():
    torch.manual_seed(0)
    model = _Tiny().double()
    twin = _Tiny().double()
    twin.load_state_dict(model.state_dict())
    lr, wd, mu, betas = 0.02, 0.1, 0.95, (0.9, 0.95)
    opt = Muon(
        [
            {"params": [model.proj.weight, model.up.weight], "use_muon": True, "weight_decay": wd},
            {"params": [model.embed.weight], "weight_decay": wd},
            {"params": [model.proj.bias], "weight_decay": 0.0},
        ],
        lr=lr,
        betas=betas,
        momentum=mu,
    )
    adamw = torch.optim.AdamW(
        [{"params": [twin.embed.weight], "weight_decay": wd}, {"params": [twin.proj.bias], "weight_decay": 0.0}],
        lr=lr,
        betas=betas,
    )
    matrices = [twin.proj.weight, twin.up.weight]
    momentum = [torch.zeros_like(w) for w in matrices]
    for _ in range(3):
        grads = {n: torch.randn_like(p) for n, p in model.named_parameters()}
        for (n, p), q in zip(model.named_parameters(), twin.parameters()):
            p.grad, q.grad = grads[n].clone(), grads[n].clone()
        opt.step()
        adamw.step()
        with torch.no_grad():
            for w, m in zip(matrices, momentum):
                m.mul_(mu).add_((1 - mu) * w.grad)
                nesterov = (1 - mu) * w.grad + mu * m
                w.mul_(1 - lr * wd).sub_(lr * 0.2 * math.sqrt(max(w.shape)) * _reference_ns(nesterov))
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-12), n


def test_the_state_dict_round_trips_and_the_next_step_repeats():
    torch.manual_seed(1)
    model = _Tiny()

    def groups(m):
        return [{"params": [m.proj.weight, m.up.weight], "use_muon": True}, {"params": [m.embed.weight, m.proj.bias]}]

    opt = Muon(groups(model), lr=0.01)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    twin = _Tiny()
    twin.load_state_dict(model.state_dict())
    again = Muon(groups(twin), lr=0.01)
    again.load_state_dict(copy.deepcopy(opt.state_dict()))  # as from a file: no shared tensors
    for p, q in zip(model.parameters(), twin.parameters()):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    opt.step()
    again.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_build_optimizer_splits_a_model_as_moonlight_does():
    model = CausalLM(get_config("kimi-k3-tiny", vocab_size=300))
    opt = build_optimizer(model, TrainConfig())
    assert isinstance(opt, Muon)
    name = {id(p): n for n, p in model.named_parameters()}
    muon, decay, keep = ([name[id(p)] for p in g["params"]] for g in opt.param_groups)
    assert [g["use_muon"] for g in opt.param_groups] == [True, False, False]
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(decay)
    assert any(".experts.0.w1" in n for n in muon) and any("q_proj" in n for n in muon)
    params = dict(model.named_parameters())
    assert all(params[n].dim() == 2 and min(params[n].shape) > 1 for n in muon)
    assert all(no_decay(n, params[n]) for n in keep) and not any(no_decay(n, params[n]) for n in muon + decay)
    assert len(muon) + len(decay) + len(keep) == len(params)
    assert isinstance(build_optimizer(model, TrainConfig(optimizer="adamw")), torch.optim.AdamW)


def test_muon_bad_settings_name_the_argument():
    with pytest.raises(ValueError, match="`optimizer` must be one of 'muon', 'adamw', got 'sgd'"):
        TrainConfig(optimizer="sgd")
    with pytest.raises(ValueError, match=r"only matrices \(2-D\), got shapes \[\(2, 3, 4\)\]"):
        Muon([{"params": [nn.Parameter(torch.zeros(2, 3, 4))], "use_muon": True}])
    with pytest.raises(ValueError, match="`momentum` must be in \\[0, 1\\), got 1.0"):
        Muon([nn.Parameter(torch.zeros(2, 2))], momentum=1.0)


def test_a_checkpoint_from_before_the_optimizer_field_resumes_with_adamw():
    fields = {k: v for k, v in TrainConfig().__dict__.items() if k != "optimizer"}
    assert saved_train_config(fields).optimizer == "adamw"
    assert saved_train_config({**fields, "optimizer": "muon"}).optimizer == "muon"


def test_muon_scale_matches_adamw_rms():
    assert muon_scale(torch.Size([64, 256])) == pytest.approx(0.2 * 16)


def test_the_cli_flag_reaches_the_config_and_a_resume_keeps_the_checkpoints():
    from k3.cli import build_parser
    from k3.cli.train import train_config
    from k3.training.loop import _resume_overrides

    assert train_config(build_parser().parse_args(["train", "--optimizer", "adamw"])).optimizer == "adamw"
    assert train_config(build_parser().parse_args(["train"])).optimizer == "muon"
    saved = TrainConfig(optimizer="adamw")
    assert _resume_overrides(TrainConfig(), saved) == {}  # not asked: the checkpoint's AdamW goes on
    with pytest.raises(ValueError, match="`optimizer` 'muon' \\(the checkpoint's: 'adamw'\\)"):
        _resume_overrides(TrainConfig(), saved, asked=("optimizer",))


def test_matrices_orthogonalised_in_runs_take_the_step_of_one_stack(monkeypatch):
    """Muon orthogonalises the matrices of one shape in runs of at most STACK_VALUES values (its
    workspace bounded); with runs of one matrix the step is the one-stack step (float64, to rounding)."""
    import k3.training.muon as muon

    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(6, 4, dtype=torch.float64)) for _ in range(5)]
    grads = [torch.randn_like(p) for p in params]
    results = []
    for values in (10**6, 24):  # one stack of 5; runs of 1 matrix
        monkeypatch.setattr(muon, "STACK_VALUES", values)
        copies = [nn.Parameter(p.detach().clone()) for p in params]
        for p, g in zip(copies, grads):
            p.grad = g.clone()
        optimizer = Muon([{"params": copies, "use_muon": True}], lr=0.1)
        for _ in range(2):
            optimizer.step()
        results.append(torch.stack([p.detach() for p in copies]))
    assert len(muon._stacks(list(range(5)), torch.Size([6, 4]))) == 5
    assert torch.allclose(results[0], results[1], rtol=0, atol=1e-12)
    assert not torch.equal(results[0], torch.stack([p.detach() for p in params]))  # the step moved them
