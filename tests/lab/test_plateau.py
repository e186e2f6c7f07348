"""The lab's training to convergence (`train_until_plateau`) and its loss and accuracy at the scored positions."""

import pytest
import torch
import torch.nn.functional as F

from k3.lab.synthetic import (
    Plateau,
    Size,
    accuracy_by_kind,
    build_model,
    masked_loss,
    mixer_config,
    train_until_plateau,
)
from k3.lab.tasks import IGNORE, Vocab, mqar

VOCAB = Vocab(8, 8)
SIZE = Size(width=16, layers=2, head_dim=4)


def _sample(g):
    return mqar(4, 8, 2, VOCAB, generator=g)


def _recording(scores):
    """A score function that returns `scores` in turn (then its last) and remembers the rate it saw."""
    seen = []

    def score(model):
        seen.append(model.training)
        return scores[min(len(seen) - 1, len(scores) - 1)]

    return score, seen


def test_a_flat_score_ends_the_stable_phase_after_patience_then_decays():
    score, seen = _recording([0.5])  # never improves after the first evaluation
    plateau = Plateau(every=2, patience=3, min_gain=0.01, min_steps=4, max_steps=100, decay=0.5, warmup=1)
    model, curve = train_until_plateau(mixer_config("deltanet", VOCAB.size, SIZE), _sample, score, plateau)
    # evaluations at 2 (the best), 4, 6, 8: three without a gain -> the stable phase ends at step 8
    assert curve.stopped_by == "plateau" and curve.stable_steps == 8
    assert curve.steps == 12 and [s for s, _ in curve.points] == [2, 4, 6, 8, 10, 12]  # decay over 0.5 x 8 steps
    assert not model.training and seen == [False] * len(seen)  # scored in eval mode


def test_an_improving_score_runs_to_the_budget():
    score, _ = _recording([0.1 * i for i in range(1, 50)])
    plateau = Plateau(every=2, patience=2, min_steps=2, max_steps=10, decay=0.2, warmup=1)
    _, curve = train_until_plateau(mixer_config("deltanet", VOCAB.size, SIZE), _sample, score, plateau)
    assert curve.stopped_by == "budget" and curve.stable_steps == 10 and curve.steps == 12


def test_min_steps_holds_off_the_plateau():
    score, _ = _recording([0.5])
    plateau = Plateau(every=1, patience=1, min_steps=6, max_steps=50, decay=0.5, warmup=1)
    _, curve = train_until_plateau(mixer_config("deltanet", VOCAB.size, SIZE), _sample, score, plateau)
    assert curve.stable_steps == 6 and curve.steps == 9


def test_a_run_still_at_chance_is_not_ended_by_a_plateau():
    # flat at chance until the 5th evaluation, then it leaves chance and plateaus there
    score, _ = _recording([0.01] * 5 + [0.3])
    plateau = Plateau(every=1, patience=2, min_steps=1, max_steps=50, decay=0.5, warmup=1, floor=0.05)
    _, curve = train_until_plateau(mixer_config("deltanet", VOCAB.size, SIZE), _sample, score, plateau)
    # without the floor it would end at step 3 (two evaluations without a gain); with it: best 0.3 at step 6,
    # then steps 7 and 8 without a gain
    assert curve.stopped_by == "plateau" and curve.stable_steps == 8
    score, _ = _recording([0.01])  # never leaves chance: it trains to its budget
    _, curve = train_until_plateau(mixer_config("deltanet", VOCAB.size, SIZE), _sample, score, plateau)
    assert curve.stopped_by == "budget" and curve.stable_steps == 50


def test_the_rate_warms_up_holds_and_decays_to_zero(monkeypatch):
    rates = []
    real_step = torch.optim.AdamW.step

    def spy(self, *a, **k):
        rates.append(self.param_groups[0]["lr"])
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", spy)
    score, _ = _recording([0.5])
    plateau = Plateau(every=4, patience=1, min_steps=8, max_steps=100, decay=0.5, warmup=4)
    train_until_plateau(mixer_config("deltanet", VOCAB.size, SIZE), _sample, score, plateau, lr=1e-2)
    assert rates[:4] == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2]) and rates[4:8] == pytest.approx([1e-2] * 4)
    assert rates[8:] == pytest.approx([1e-2, 7.5e-3, 5e-3, 2.5e-3])  # 4 decay steps, the last at 1/4


@pytest.mark.parametrize(
    "field,value",
    [("every", 0), ("patience", 0), ("max_steps", 0), ("decay", 0.0), ("decay", 1.5), ("floor", -0.1), ("floor", 1.0)],
)
def test_plateau_rejects_bad_settings(field, value):
    with pytest.raises(ValueError, match=f"Plateau.{field}"):
        Plateau(**{field: value})


def test_loss_and_accuracy_at_the_scored_positions_match_the_whole_logits():
    torch.manual_seed(0)
    model = build_model(mixer_config("kda+mla", VOCAB.size, SIZE)).eval()
    batch = mqar(3, 12, 3, VOCAB, generator=torch.Generator().manual_seed(2))
    logits = model(batch.inputs)
    expected = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE)
    torch.testing.assert_close(masked_loss(model, batch), expected)
    scored = batch.targets != IGNORE
    right = (logits.argmax(-1) == batch.targets)[scored].float().mean().item()
    assert accuracy_by_kind(model, batch) == {1: pytest.approx(right)}


def test_the_lab_steps_through_trainings_step_on_the_scored_positions():
    """`training_step` with targets: the loss is the masked loss, and the update is AdamW's on its gradient."""
    import copy

    from k3.lab.synthetic import recipe
    from k3.training import build_optimizer, training_step

    torch.manual_seed(0)
    model = build_model(mixer_config("deltanet", VOCAB.size, SIZE))
    twin = copy.deepcopy(model)
    batch = _sample(torch.Generator().manual_seed(1))
    cfg = recipe(1e-2, warmup=1)
    loss = training_step(model, build_optimizer(model, cfg, fused=False), batch.inputs, cfg, targets=batch.targets)
    assert loss == pytest.approx(masked_loss(twin, batch).item())
    optimizer = torch.optim.AdamW(
        [
            {
                "params": [
                    p
                    for n, p in twin.named_parameters()
                    if p.dim() >= 2 and not n.endswith(("A_log", "dt_bias")) and "norm" not in n
                ],
                "weight_decay": 0.1,
            },
            {
                "params": [
                    p
                    for n, p in twin.named_parameters()
                    if not (p.dim() >= 2 and not n.endswith(("A_log", "dt_bias")) and "norm" not in n)
                ],
                "weight_decay": 0.0,
            },
        ],
        lr=1e-2,
        betas=(0.9, 0.98),
    )
    masked_loss(twin, batch).backward()
    torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
    optimizer.step()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.allclose(a, b, atol=1e-6), name


def test_a_non_finite_loss_stops_the_run_where_it_is(monkeypatch):
    """Training's step refuses a non-finite loss before the weights change; the lab's run ends there."""
    from k3.lab import synthetic
    from k3.training.step import NonFiniteLossError

    taken = []

    def step(model, opt, inputs, cfg, targets=None):
        if len(taken) == 3:
            raise NonFiniteLossError("the training loss is nan")
        taken.append(1)
        return 1.0

    monkeypatch.setattr(synthetic, "training_step", step)
    score, _ = _recording([0.5])
    plateau = Plateau(every=1, patience=5, min_steps=1, max_steps=50, warmup=1)
    _, curve = train_until_plateau(mixer_config("deltanet", VOCAB.size, SIZE), _sample, score, plateau)
    assert curve.stopped_by == "diverged" and curve.steps == 3 and curve.stable_steps is None
    _, losses = synthetic.train_on_task(mixer_config("deltanet", VOCAB.size, SIZE), _sample, 10, warmup=1)
    assert losses == []  # `taken` is at 3: the first step already raises
