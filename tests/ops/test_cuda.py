"""The ops on a CUDA device (skipped without one): same results as on the CPU, device kept, packing works.

k3.ops is plain PyTorch, so nothing is CUDA-specific; these tests guard against CPU-only assumptions
(tensors created on the default device, host syncs that break, cached masks on the wrong device).
"""

from __future__ import annotations

import pytest
import torch

from k3.ops import kernels

from .helpers import DELTA, GDN, KDA, MIXERS, assert_rel, make_inputs, mixer_params, tol_for

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


@pytest.mark.skipif(not kernels.fla_installed(), reason="needs fla-core and triton: pip install 'k3[cuda]'")
@pytest.mark.parametrize("mixer", mixer_params([KDA, GDN, DELTA]))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_behind_k3s_ops_equals_k3s_own_form_on_cuda(mixer, dtype):
    """On the GPU "auto" runs fla's kernels: outputs, final state and gradients equal k3's own form (float64
    on the same numbers) to the dtype's tolerance (fla's float32 dots may run in TF32). float32 DeltaNet
    runs k3's own form (fla refuses it). KDA's and Gated DeltaNet's gates are -5 sigmoid (make_inputs)."""
    import k3.ops as ops

    x = make_inputs(mixer, B=2, T=150, H=3, K=64, V=32, seed=11, initial_state=True)
    options = dict(output_final_state=True, use_qk_l2norm=True, chunk_size=64)
    if mixer.gate == "channel":
        options["lower_bound"] = -5.0

    def run(inputs, choice):
        leaves = {n: t.clone().requires_grad_() for n, t in inputs.items()}
        with ops.use_kernels(choice):
            o, S = mixer("chunk", leaves, **options)
        (o.float().square().sum() + S.sum()).backward()
        return [o, S] + [t.grad for t in leaves.values()]

    got = run({n: (t.float() if n == "initial_state" else t.to(dtype)).cuda() for n, t in x.items()}, "auto")
    want = run({n: t.cuda() for n, t in x.items()}, "torch")
    tol = {torch.float32: 5e-3, torch.bfloat16: 3e-2}[dtype]
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.device.type == "cuda" and torch.isfinite(a).all(), i
        assert_rel(a.double(), b, tol, f"{mixer.name} {dtype} output {i}")
