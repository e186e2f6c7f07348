"""The serving plan's figures against hand-computed values on a tiny preset."""

import pytest

from k3.models import count_params, get_config
from k3.plan.serving import ServeSettings, cache_bytes, mxfp4_bytes, plan_serving, weight_bytes
from k3.plan.shapes import model_shapes


def test_mxfp4_is_4_25_bits_per_weight():
    assert mxfp4_bytes((3072, 3584)) == 3072 * 3584 * 4.25 / 8
    assert mxfp4_bytes((2, 33)) == 2 * 2 * 17  # a partial block costs a whole one


def test_tiny_weights_and_cache_by_hand():
    config = get_config("kimi-k3-tiny")
    shapes = model_shapes(config)
    n = count_params(config)
    routed = n.breakdown["routed experts"]
    mx = weight_bytes(config, shapes, "mxfp4")
    assert mx["routed experts (mxfp4)"] == routed * 17 / 32  # 64- and 64-wide inputs: whole blocks
    assert mx["everything else (bf16)"] == 2 * (n.total - routed)
    assert sum(weight_bytes(config, shapes, "bf16").values()) == 2 * n.total
    context = 1000
    cache = cache_bytes(config, context)
    assert sum(cache.values()) == n.mla_cache_bytes_per_token * context + n.recurrent_state_bytes_per_sequence


def test_sequences_fit_and_decode_is_bounded():
    config = get_config("kimi-k3-tiny")
    f = plan_serving(config, ServeSettings(gpu="h100", gpus=1, context=4096, concurrent=4))
    usable = 0.9 * 80e9
    assert f["sequences per replica"] == (usable - f["weights"]) // f["cache per sequence"]
    one = f["decode, one sequence alone: tokens/s per sequence"]
    many = f["decode, 4 sequences together: tokens/s per replica"]
    assert many > one  # a batch shares the weight reads
    assert f["decode step, one sequence alone: bandwidth-bound time"] == pytest.approx(
        f["decode step, one sequence alone: bytes read"] / 3.35e12
    )


def test_kimi_k3_needs_two_h200_nodes_at_1m():
    f = plan_serving(get_config("kimi-k3"), ServeSettings(gpu="h200"))
    assert f.inputs["gpus per replica"] == 16 and f["sequences per replica"] >= 1


def test_bad_input():
    with pytest.raises(ValueError, match="--experts"):
        plan_serving(get_config("kimi-k3-tiny"), ServeSettings(experts="fp4"))
    with pytest.raises(ValueError, match="--context"):
        plan_serving(get_config("kimi-k3-tiny"), ServeSettings(context=0))
