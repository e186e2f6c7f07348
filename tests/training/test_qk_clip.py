"""QK-Clip (k3.training.qk_clip): after the clip every head's largest logit on the same batch is at most
tau (float64, to 1e-9), the weights are the formula's (q^C, k^C x sqrt(gamma), MLA's q^R x gamma, values
and everything else untouched), heads at or under tau keep their weights bit for bit, and inference
records nothing; `k3 train --qk-clip` (default 100 with Muon, off with AdamW), metrics.jsonl's fields,
exact resume with the clip acting, and under fsdp over 2 processes the maxima all-reduced (slow)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from k3.cli import main
from k3.cli.parser import build_parser
from k3.cli.train import train_config as cli_train_config
from k3.layers import MultiHeadAttention, MultiHeadLatentAttention, max_logit
from k3.layers.max_logit import causal_max_logits
from k3.models import CausalLM, get_config
from k3.training import TrainConfig, build_optimizer, qk_clip, train, train_step, training_step
from k3.training.config import qk_clip_threshold, saved_train_config
from k3.training.metrics import METRICS_FILE, read_metrics

from ..processes import free_port, join, leave
from . import test_train

train_config = test_train.config
corpus = test_train.corpus  # test_train's module fixture, used here by name

CPU = torch.device("cpu")


def mla(q_lora_rank: int | None = 8, rope_theta: float | None = 10000.0) -> MultiHeadLatentAttention:
    torch.manual_seed(0)
    return MultiHeadLatentAttention(
        16,
        3,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=8,
        qk_nope_head_dim=4,
        qk_rope_head_dim=2,
        v_head_dim=5,
        rope_theta=rope_theta,
    ).double()


def mha() -> MultiHeadAttention:
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 4).double()
    with torch.no_grad():
        layer.c_attn.bias.normal_()  # (zero at initialisation: the clip must scale it too)
    return layer


LAYERS = {"mla": mla, "mla-no-lora-nope": lambda: mla(None, None), "mha": mha}


def batch() -> torch.Tensor:
    return 30 * torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def recorded(layer, x: torch.Tensor) -> torch.Tensor:
    """Every head's largest logit on `x`, recorded as in a training step."""
    layer.train()
    layers = qk_clip.begin_step(layer, 1.0)
    layer(x)
    return qk_clip.head_max_logits(layers, CPU)


def brute_max_logits(q, k, scale, start=None) -> torch.Tensor:
    """Every score written out, masked as causal_attention masks them."""
    T, S = q.shape[1], k.shape[1]
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    allowed = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    if start is not None:
        allowed = allowed & (torch.arange(S) >= start[:, None])[:, None, None, :]
    return scores.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))


@pytest.mark.parametrize("bound", ["values", "queries"])
@pytest.mark.parametrize("T,S,padded", [(7, 7, False), (3, 9, False), (5, 8, True)])
def test_the_blocked_maximum_is_the_maximum_of_all_scores(monkeypatch, T, S, padded, bound):
    if bound == "values":
        monkeypatch.setattr(max_logit, "MAX_SCORES", 40)  # blocks of a query or two
    else:
        monkeypatch.setattr(max_logit, "QUERY_BLOCK", 2)  # blocks of two queries against the keys they see
    g = torch.Generator().manual_seed(0)
    q, k = (
        torch.randn(2, T, 3, 4, generator=g, dtype=torch.float64),
        torch.randn(2, S, 3, 4, generator=g, dtype=torch.float64),
    )
    start = torch.tensor([0, 2]) if padded else None
    assert torch.equal(causal_max_logits(q, k, 0.5, start), brute_max_logits(q, k, 0.5, start))


def test_mla_records_the_logits_of_its_attention():
    layer, x = mla(), batch()
    q, c, k_pe = layer._queries_and_latents(x, 0)
    B, T, H, _ = q.shape
    k_nope = layer.kv_b_proj(c).view(B, T, H, -1)[..., : layer.dn]
    k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(B, T, H, layer.dr)], -1)
    torch.testing.assert_close(recorded(layer, x), brute_max_logits(q, k, layer.scale), rtol=1e-12, atol=0)


@pytest.mark.parametrize("kind", LAYERS)
def test_after_the_clip_no_head_is_above_tau_and_heads_under_it_keep_their_weights(kind):
    layer, x = LAYERS[kind](), batch()
    before = recorded(layer, x)
    tau = float(before.median())  # one head of 3 (MLA) or 2 of 4 (MHA) above it
    weights = {n: p.detach().clone() for n, p in layer.named_parameters()}
    largest, clipped = qk_clip.clip(qk_clip.attention_layers(layer), tau)
    over = before > tau
    assert largest == before.max().item() and clipped == int(over.sum()) >= 1 and not over.all()
    after = recorded(layer, x)
    assert (after <= tau * (1 + 1e-9)).all(), (after, tau)
    torch.testing.assert_close(after[over], torch.full_like(after[over], tau), rtol=1e-9, atol=0)
    assert torch.equal(after[~over], before[~over])  # their logits, as their weights, unchanged
    # the formula's weights, row by row; every other parameter untouched
    gamma = torch.where(over, tau / before, torch.ones_like(before))
    expected = {n: w.clone() for n, w in weights.items()}
    if isinstance(layer, MultiHeadLatentAttention):
        q_name = "q_proj.weight" if layer.q_lora_rank is None else "q_b_proj.weight"
        q = expected[q_name].view(layer.num_heads, layer.dn + layer.dr, -1)
        q[:, : layer.dn] *= gamma.sqrt()[:, None, None]
        q[:, layer.dn :] *= gamma[:, None, None]
        expected["kv_b_proj.weight"].view(layer.num_heads, layer.dn + layer.dv, -1)[:, : layer.dn] *= gamma.sqrt()[
            :, None, None
        ]
        touched = {q_name, "kv_b_proj.weight"}
    else:
        D = layer.hidden_size // layer.num_heads
        expected["c_attn.weight"].view(3, layer.num_heads, D, -1)[:2] *= gamma.sqrt()[None, :, None, None]
        expected["c_attn.bias"].view(3, layer.num_heads, D)[:2] *= gamma.sqrt()[None, :, None]
        touched = {"c_attn.weight", "c_attn.bias"}
    for name, p in layer.named_parameters():
        if name in touched:
            torch.testing.assert_close(p, expected[name], rtol=1e-15, atol=0)
            rows = p.detach().view(layer.num_heads if kind != "mha" else 3 * layer.num_heads, -1)
            old = weights[name].view_as(rows)
            heads = ~over if kind != "mha" else (~over).repeat(3)
            assert torch.equal(rows[heads], old[heads]), name  # heads under tau: bit for bit
        else:
            assert torch.equal(p, weights[name]), name


@pytest.mark.parametrize("kind", LAYERS)
def test_a_tau_above_every_head_changes_nothing(kind):
    layer, x = LAYERS[kind](), batch()
    before = recorded(layer, x)
    weights = {n: p.detach().clone() for n, p in layer.named_parameters()}
    assert qk_clip.clip(qk_clip.attention_layers(layer), float(before.max()) * 2) == (before.max().item(), 0)
    assert all(torch.equal(p, weights[n]) for n, p in layer.named_parameters())


@pytest.mark.parametrize("kind", LAYERS)
def test_inference_records_nothing(kind):
    layer, x = LAYERS[kind](), batch()
    qk_clip.begin_step(layer, 1.0)
    with torch.no_grad():
        layer(x)  # training mode, no gradients
    layer.eval()
    layer(x)  # gradients, evaluation mode
    assert layer.max_logits is None
    layer.train()
    qk_clip.begin_step(layer, 0.0)  # QK-Clip off: the trainer asks for nothing
    layer(x)
    assert layer.max_logits is None and not layer.record_max_logits
    qk_clip.begin_step(layer, 1.0)
    layer(x)
    assert layer.max_logits is not None


def test_the_default_is_100_with_muon_and_off_with_adamw_and_bad_values_are_refused(capsys):
    parse = build_parser().parse_args
    assert qk_clip_threshold(cli_train_config(parse(["train"]))) == 100.0
    assert qk_clip_threshold(cli_train_config(parse(["train", "--optimizer", "adamw"]))) == 0.0
    assert qk_clip_threshold(cli_train_config(parse(["train", "--qk-clip", "0"]))) == 0.0
    assert qk_clip_threshold(cli_train_config(parse(["train", "--optimizer", "adamw", "--qk-clip", "30"]))) == 30.0
    for bad in ("-1", "inf", "nan", "big"):
        assert main(["train", "--qk-clip", bad]) == 2
        assert (
            f"--qk-clip: expected a logit bound (0: off), a finite number >= 0, got '{bad}'" in capsys.readouterr().err
        )
    for bad in (-1.0, math.inf, math.nan, True):
        with pytest.raises(ValueError, match="`qk_clip` must be a finite number >= 0"):
            TrainConfig(qk_clip=bad)
    with pytest.raises(ValueError, match="`tau` must be a finite number > 0"):
        qk_clip.clip([], 0.0)
    # a checkpoint saved before the field existed trained without QK-Clip
    assert qk_clip_threshold(saved_train_config({"optimizer": "muon"})) == 0.0


def config(corpus, out, **kw) -> TrainConfig:
    """test_train's tiny run, without the final evaluation, on one thread."""
    return train_config(corpus, out, **{"final_eval_tokens": 0, "threads": 1, **kw})


TINY_TAU = 1e-3  # under the tiny model's logits (~1e-2): the clip acts on every step


def test_metrics_log_the_largest_logit_and_the_clipped_heads_and_resume_is_exact(corpus, tmp_path):
    full = train(config(corpus, tmp_path / "full", qk_clip=TINY_TAU), progress=False)
    records = read_metrics(tmp_path / "full" / METRICS_FILE)
    assert all(r["max_logit"] > TINY_TAU and r["qk_clipped_heads"] >= 1 for r in records), records
    train(config(corpus, tmp_path / "half", qk_clip=TINY_TAU, max_steps=3), progress=False)
    resumed = train(TrainConfig(max_steps=6), resume=str(tmp_path / "half"), progress=False)
    assert resumed["loss"] == full["loss"]
    figures = [{k: r.get(k) for k in ("step", "loss", "max_logit", "qk_clipped_heads")} for r in records]
    assert [{k: r.get(k) for k in figures[0]} for r in read_metrics(tmp_path / "half" / METRICS_FILE)] == figures
    # another tau on resume is refused, as any other setting of the optimizer
    with pytest.raises(ValueError, match=r"`qk_clip` 100.0 \(the checkpoint's: 0.001\)"):
        train(TrainConfig(max_steps=8, qk_clip=100.0), resume=str(tmp_path / "half"), progress=False)
    # the clip is not a no-op: without it the run differs
    unclipped = train(config(corpus, tmp_path / "off", qk_clip=0.0, max_steps=3), progress=False)
    assert unclipped["loss"][1:] != full["loss"][1:3]
    assert "max_logit" not in read_metrics(tmp_path / "off" / METRICS_FILE)[0]
    adamw = train(config(corpus, tmp_path / "adamw", optimizer="adamw", max_steps=1, warmup_steps=1), progress=False)
    assert adamw["step"] == [1] and set(read_metrics(tmp_path / "adamw" / METRICS_FILE)[0]) == {
        "step",
        "loss",
        "lr",
        "tokens_per_s",
        "grad_norm",
        "val_bpb",
    }
    config_json = json.loads((tmp_path / "half" / "config.json").read_text())
    assert config_json["train"]["qk_clip"] == TINY_TAU


def test_gradient_accumulation_clips_with_the_maximum_over_the_micro_batches():
    """2 micro-batches of 2 windows = one batch of 4: the same largest logit, the same clipped weights."""
    cfg = TrainConfig(qk_clip=TINY_TAU, optimizer="adamw", lr=1e-3)
    windows = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(0))
    results = []
    for accum in (1, 2):
        torch.manual_seed(0)
        model = CausalLM(get_config("gpt2-tiny", vocab_size=64, hidden_size=32, num_layers=2)).double()
        optimizer = build_optimizer(model, cfg)
        s = train_step(
            model, optimizer, windows, TrainConfig(qk_clip=TINY_TAU, optimizer="adamw", lr=1e-3, grad_accum=accum)
        )
        results.append((s.max_logit, s.qk_clipped_heads, {n: p.detach().clone() for n, p in model.named_parameters()}))
    (logit1, heads1, w1), (logit2, heads2, w2) = results
    assert heads1 == heads2 >= 1 and logit1 == pytest.approx(logit2, rel=1e-12)
    for name in w1:
        torch.testing.assert_close(w1[name], w2[name], rtol=1e-10, atol=1e-12)


# -- fsdp over 2 processes: every rank clips with the global maxima ---------------------------------
WORLD = 2


def _fsdp_worker(rank: int, port: int, root: str) -> None:
    from torch.distributed.tensor import DTensor

    from k3.training import build
    from k3.training.parallel import init_parallel

    join(rank, WORLD, port)
    out = {}
    for preset in ("kimi-k3-tiny", "gpt2-tiny"):
        cfg = TrainConfig(qk_clip=TINY_TAU, lr=3e-3)
        dims = init_parallel("fsdp")
        model = tiny_model(preset)
        optimizer, _ = build(model, cfg, dims)
        layers = qk_clip.attention_layers(model)
        assert any(isinstance(p, DTensor) for layer in layers for p in layer.parameters())
        result = train_step(model, optimizer, windows(), cfg, dims)
        local = qk_clip.head_max_logits(layers, CPU)  # what this rank's tokens gave, before the all-reduce
        weights = {
            n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()
        }
        out[preset] = {
            "local": local,
            "max_logit": result.max_logit,
            "clipped": result.qk_clipped_heads,
            "weights": weights,
        }
    parts = [None] * WORLD
    torch.distributed.all_gather_object(parts, out)
    if rank == 0:
        torch.save(parts, f"{root}/fsdp.pt")
    leave()


def tiny_model(preset: str) -> CausalLM:
    torch.manual_seed(0)
    overrides = (
        {"hidden_size": 32, "num_layers": 3, "num_experts": 8, "num_experts_per_tok": 2}
        if preset == "kimi-k3-tiny"
        else {"hidden_size": 32, "num_layers": 2}
    )
    return CausalLM(get_config(preset, vocab_size=257, **overrides))


def windows() -> torch.Tensor:
    return torch.randint(0, 257, (2, 9), generator=torch.Generator().manual_seed(1))


@pytest.mark.slow
def test_fsdp_ranks_clip_with_the_maximum_over_ranks_as_one_process_does(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.multiprocessing.spawn(_fsdp_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD)
        ranks = torch.load(tmp_path / "fsdp.pt", weights_only=False)
        for preset in ("kimi-k3-tiny", "gpt2-tiny"):
            model = tiny_model(preset)
            cfg = TrainConfig(qk_clip=TINY_TAU, lr=3e-3)
            optimizer = build_optimizer(model, cfg)
            training_step(model, optimizer, windows(), cfg)
            layers = qk_clip.attention_layers(model)
            single = qk_clip.head_max_logits(layers, CPU)
            r0, r1 = ranks[0][preset], ranks[1][preset]
            # each rank saw half the batch; the clip used the maximum of both, the single process's
            assert not torch.equal(r0["local"], r1["local"])
            torch.testing.assert_close(torch.maximum(r0["local"], r1["local"]), single, rtol=1e-5, atol=0)
            assert r0["max_logit"] == r1["max_logit"] == pytest.approx(single.max().item(), rel=1e-5)
            assert r0["clipped"] == r1["clipped"] == int((single > TINY_TAU).sum()) >= 1
            for name, p in model.named_parameters():
                assert torch.equal(r0["weights"][name], r1["weights"][name]), name
                torch.testing.assert_close(r0["weights"][name], p.detach(), rtol=1e-5, atol=1e-2 * cfg.lr, msg=name)
    finally:
        torch.set_num_threads(threads)
