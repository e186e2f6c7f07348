"""The training plan's figures against hand-computed values on tiny presets."""

import pytest

from k3.models import count_params, get_config
from k3.plan.costs import activation_bytes_per_token, train_flops_per_token
from k3.plan.shapes import Layout, model_shapes, rank_values, shard_rows
from k3.plan.training import TrainSettings, default_ep, plan_training


@pytest.mark.parametrize("name", ["gpt2-tiny", "kimi-k3-tiny", "kimi-linear-tiny"])
def test_shapes_count_every_parameter(name):
    config = get_config(name)
    assert model_shapes(config).numel() == count_params(config).total


def test_shards_partition_the_model():
    """Every rank's values under FSDP2 + EP add up to the model: nothing lost, nothing twice."""
    config = get_config("kimi-k3-tiny")
    shapes, layout = model_shapes(config), Layout(gpus=8, pp=2, fsdp=4, ep=2)
    held = [sum(rank_values(shapes, layout, r).values()) for r in range(8)]
    # each stage's experts are held once per expert split, the rest once: the model, once
    assert sum(held) == count_params(config).total


def test_shard_rows_is_torch_chunk():
    import torch

    for rows, size in [(10, 4), (3, 8), (7168, 1024), (1, 3)]:
        chunks = [c.shape[0] for c in torch.empty(rows).chunk(size)]
        chunks += [0] * (size - len(chunks))
        assert [shard_rows(rows, size, i) for i in range(size)] == chunks


def test_gpt2_tiny_on_one_gpu_by_hand():
    config = get_config("gpt2-tiny")
    T = 256
    f = plan_training(
        config, TrainSettings(gpus=1, gpu="h100", seq_len=T, recompute="full", global_batch_tokens=T, optimizer="adamw")
    )
    n = count_params(config)
    assert f["memory: parameters (fp32, sharded)"] == 4 * n.total
    assert f["memory: gradients (fp32, sharded)"] == 4 * n.total
    assert f["memory: optimizer state (adamw)"] == 8 * n.total
    d, L = config.hidden_size, config.num_layers
    # 6 x active + causal attention: 3 x (2 FLOPs x (d for q.k + d for the values) x (T + 1) / 2) per layer
    assert f["FLOPs per token"] == pytest.approx(6 * n.active + 6 * L * d * (T + 1))
    # full recompute: each layer's input (bf16), one layer's working set, the logits (bf16 + fp32)
    acts = activation_bytes_per_token(config, range(L), "full")
    assert acts["layer inputs"] == 2 * d * L and acts["logits"] == 6 * config.vocab_size
    assert f["memory: activations"] == pytest.approx(T * sum(acts.values()))
    step = T * f["FLOPs per token"] / (989.5e12 * 0.40)
    assert f["step time"] == pytest.approx(step)
    assert f["GPU-hours per trillion tokens"] == pytest.approx(step / T * 1e12 / 3600)


def test_muon_keeps_one_moment_on_matrices():
    config = get_config("kimi-k3-tiny")
    adamw = plan_training(config, TrainSettings(gpus=1, recompute="none", optimizer="adamw"))
    muon = plan_training(config, TrainSettings(gpus=1, recompute="none"))  # the default, as k3 train's
    assert TrainSettings().optimizer == "muon"
    n = count_params(config).total
    tables = 2 * config.vocab_size * config.hidden_size  # embeddings and head stay on AdamW
    assert adamw["memory: optimizer state (adamw)"] == 8 * n
    assert tables * 8 < muon["memory: optimizer state (muon)"] < 4 * n + tables * 4 + 8 * n // 100


def test_recompute_lowers_activations_and_the_planner_picks_the_least_that_fits():
    config = get_config("kimi-k3-tiny")
    acts = [
        sum(activation_bytes_per_token(config, range(config.num_layers), r).values())
        for r in ("none", "selective", "full")
    ]
    assert acts[0] > acts[1] > acts[2]
    assert plan_training(config, TrainSettings(gpus=1)).inputs["recompute"] == "none"


def test_does_not_fit_names_the_smallest_change():
    config = get_config("gpt2-tiny")
    f = plan_training(config, TrainSettings(gpus=1, gpu="a100-40gb", seq_len=1 << 20, recompute="none"))
    assert not f["fits"]
    assert any(note.startswith("smallest change that fits on the same GPUs: --recompute") for note in f.notes)


def test_defaults_and_bad_input():
    config = get_config("kimi-k3-tiny")  # 16 experts
    assert default_ep(config, 1024) == 16 and default_ep(get_config("gpt2-tiny"), 64) == 1
    with pytest.raises(ValueError, match="--ep"):
        plan_training(config, TrainSettings(gpus=8, ep=3))
    with pytest.raises(ValueError, match="--gpus"):
        plan_training(config, TrainSettings(gpus=8, pp=3, fsdp=2))
    with pytest.raises(ValueError, match="--mfu"):
        plan_training(config, TrainSettings(mfu=1.5))


def test_flops_terms_per_mixer():
    f = train_flops_per_token(get_config("kimi-k3-tiny"), 512)
    assert set(f) == {"matmuls (6 x active)", "sequence (kda)", "sequence (mla)"}


def test_a_plan_that_fits_prints_the_k3_train_command_that_runs_it():
    from k3.cli.parser import build_parser

    f = plan_training(get_config("kimi-k3"), TrainSettings(gpus=1024, gpu="h200"))
    [line] = [n for n in f.notes if n.startswith("run it: ")]
    words = line.removeprefix("run it: ").split()
    assert words[:3] == ["torchrun", "--nnodes=128", "--nproc_per_node=8"] and words[3:5] == ["-m", "k3"]
    args = build_parser().parse_args(words[5:])
    assert (args.preset, args.parallel, args.ep, args.recompute) == ("kimi-k3", "fsdp", 64, "full")
    assert args.batch_size == 1024 and args.seq_len == 4096 and args.optimizer == "muon"
    staged = plan_training(get_config("kimi-k3"), TrainSettings(gpus=1024, gpu="h200", pp=2))
    assert any("no pipeline parallelism" in n for n in staged.notes)
