"""The ops on a CUDA device (skipped without one): same results as on the CPU, device kept, packing works.

k3.ops is plain PyTorch, so nothing is CUDA-specific; these tests guard against CPU-only assumptions
(tensors created on the default device, host syncs that break, cached masks on the wrong device).
"""

from __future__ import annotations

import pytest
import torch

from .helpers import MIXERS, assert_rel, make_inputs, mixer_params, tol_for

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def to_cuda(inputs: dict) -> dict:
    return {name: (tuple(s.cuda() for s in x) if isinstance(x, tuple) else x.cuda()) for name, x in inputs.items()}


@pytest.mark.parametrize("mixer", mixer_params(MIXERS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_chunk_matches_recurrent_on_cuda(mixer, dtype):
    """On the GPU: chunk == recurrent, and both == the CPU result, with the output on the GPU."""
    x = make_inputs(mixer, B=2, T=97, H=3, K=24, V=20, dtype=dtype, seed=5, initial_state=True)
    xc = to_cuda(x)
    o_cpu, _ = mixer("chunk", x, chunk_size=32)
    o_rec, s_rec = mixer("recurrent", xc, output_final_state=True)
    o, s = mixer("chunk", xc, output_final_state=True, chunk_size=32)
    assert o.device.type == "cuda"
    assert_rel(o, o_rec, tol_for(dtype), "o chunk vs recurrent")
    assert_rel(s, s_rec, tol_for(dtype), "state chunk vs recurrent")
    assert_rel(o.cpu(), o_cpu, tol_for(dtype), "o cuda vs cpu")


@pytest.mark.parametrize("mixer", mixer_params(MIXERS))
def test_cu_seqlens_on_cuda(mixer):
    """Packed sequences on the GPU == each sequence run alone."""
    x = make_inputs(mixer, B=1, T=70, H=2, K=8, V=8, dtype=torch.float64, seed=9)
    xc = to_cuda(x)
    cu = torch.tensor([0, 13, 50, 70], device="cuda")
    o, _ = mixer("chunk", xc, cu_seqlens=cu, chunk_size=16)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        part = {name: t[:, a:b] for name, t in xc.items()}
        o_ref, _ = mixer("recurrent", part)
        assert_rel(o[:, a:b], o_ref, tol_for(torch.float64), f"sequence [{a}, {b})")


def test_the_training_header_names_the_gpu_and_measures_it():
    """On a GPU, `k3 train`'s header gives the GPU's name, memory and its own matmul speeds, not the CPU's."""
    from k3.runtime import machine_speed_words

    words = machine_speed_words(torch.device("cuda"))
    assert torch.cuda.get_device_name() in words and "GiB" in words and "TFLOP/s" in words
    assert "1024^3" not in words
