"""The chunkwise forms compute the recurrences: chunk == recurrent, state chaining, packed sequences,
and bfloat16 inputs."""

from __future__ import annotations

import pytest
import torch

from k3.ops import attention, l2norm

from .helpers import (
    BASIC_MIXERS,
    TOL_BF16,
    TOL_F32,
    TOL_F64,
    assert_rel,
    cast_inputs,
    make_inputs,
    mixer_params,
    slice_time,
    state_index,
    tol_for,
)

CHUNK_SIZES = (16, 24, 64)


# ----------------------------------------------------------------------------------------------------
# 1. chunk == recurrent


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("H", [1, 3])
@pytest.mark.parametrize("T", [1, 7, 63, 64, 65, 500])
@pytest.mark.parametrize("mixer", mixer_params())
def test_chunk_matches_recurrent_float64(mixer, T, H, with_state):
    """float64: chunk form (chunk sizes 16, 24, 64) == recurrent form to rel 1e-9, in o and final state,
    with K != V (60 vs 100) and T around and beyond chunk boundaries."""
    B = 1 if T == 500 else 2
    inputs = make_inputs(mixer, B=B, T=T, H=H, K=60, V=100, seed=T * 10 + H, initial_state=with_state)
    o_ref, s_ref = mixer("recurrent", inputs, output_final_state=True)
    assert o_ref.shape == (B, T, H, 100) and o_ref.dtype == torch.float64
    for C in CHUNK_SIZES:
        o, s = mixer("chunk", inputs, output_final_state=True, chunk_size=C)
        assert o.dtype == torch.float64
        assert_rel(o, o_ref, TOL_F64, f"o, chunk_size={C}")
        assert_rel(s, s_ref, TOL_F64, f"final state, chunk_size={C}")


@pytest.mark.parametrize("H", [1, 3])
@pytest.mark.parametrize("T", [1, 7, 63, 64, 65, 500])
@pytest.mark.parametrize("mixer", mixer_params())
def test_chunk_matches_recurrent_float32(mixer, T, H):
    """float32: chunk form (chunk sizes 16, 24, 64) == recurrent form to relative RMS 5e-4, in o and
    final state (K = 60, V = 100, with an initial state)."""
    B = 1 if T == 500 else 2
    inputs = make_inputs(
        mixer, B=B, T=T, H=H, K=60, V=100, dtype=torch.float32, seed=T * 10 + H + 1, initial_state=True
    )
    o_ref, s_ref = mixer("recurrent", inputs, output_final_state=True)
    assert o_ref.dtype == torch.float32
    for C in CHUNK_SIZES:
        o, s = mixer("chunk", inputs, output_final_state=True, chunk_size=C)
        assert o.dtype == torch.float32
        assert_rel(o, o_ref, TOL_F32, f"o, chunk_size={C}")
        assert_rel(s, s_ref, TOL_F32, f"final state, chunk_size={C}")


@pytest.mark.parametrize("mixer", mixer_params(BASIC_MIXERS))
def test_chunk_matches_recurrent_with_qk_l2norm(mixer):
    """use_qk_l2norm=True on raw q, k: chunk == recurrent, and both equal feeding l2norm(q), l2norm(k)."""
    inputs = make_inputs(mixer, B=2, T=45, H=2, K=12, V=7, seed=3, initial_state=True, normalize_keys=False)
    o_ref, s_ref = mixer("recurrent", inputs, output_final_state=True, use_qk_l2norm=True)
    o, s = mixer("chunk", inputs, output_final_state=True, use_qk_l2norm=True, chunk_size=16)
    assert_rel(o, o_ref, TOL_F64, "o")
    assert_rel(s, s_ref, TOL_F64, "final state")
    normed = dict(inputs, q=l2norm(inputs["q"]), k=l2norm(inputs["k"]))
    o_pre, s_pre = mixer("chunk", normed, output_final_state=True, chunk_size=16)
    assert_rel(o_pre, o_ref, TOL_F64, "o with pre-normalised q, k")
    assert_rel(s_pre, s_ref, TOL_F64, "state with pre-normalised q, k")


@pytest.mark.parametrize("mixer", mixer_params(BASIC_MIXERS))
@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_final_state_only_when_requested(mixer, form):
    """final_state is None unless output_final_state=True; the state dtype is the accumulation dtype."""
    for dtype, state_dtype in [
        (torch.float64, torch.float64),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
    ]:
        inputs = make_inputs(mixer, B=2, T=5, H=2, K=4, V=3, dtype=dtype, seed=1)
        o, s = mixer(form, inputs)
        assert s is None
        assert o.shape == (2, 5, 2, 3) and o.dtype == dtype
        _, s = mixer(form, inputs, output_final_state=True)
        for part in s if isinstance(s, tuple) else (s,):
            assert part.dtype == state_dtype
        if mixer.is_linear_attn:
            assert s[0].shape == (2, 2, 4, 3) and s[1].shape == (2, 2, 4)
        else:
            assert s.shape == (2, 2, 4, 3)


# ----------------------------------------------------------------------------------------------------
# 2. splitting a sequence and chaining the state


SPLITS = [1, 16, 37, 64, 99]  # with chunk_size 16: aligned (16, 64) and not (1, 37, 99)


@pytest.mark.parametrize("second", ["chunk", "recurrent"])
@pytest.mark.parametrize("mixer", mixer_params())
def test_split_and_chain_equals_one_call(mixer, second):
    """Running [0, s) with the chunk form, then [s, T) from the returned state (with the chunk or the
    recurrent form), gives the same outputs and final state as one chunk call over [0, T)."""
    T = 130
    inputs = make_inputs(mixer, B=2, T=T, H=2, K=10, V=6, seed=11, initial_state=True)
    o_full, s_full = mixer("chunk", inputs, output_final_state=True, chunk_size=16)
    for s in SPLITS:
        first = dict(slice_time(inputs, 0, s), initial_state=inputs["initial_state"])
        o1, state = mixer("chunk", first, output_final_state=True, chunk_size=16)
        rest = dict(slice_time(inputs, s, T), initial_state=state)
        kw = {"chunk_size": 16} if second == "chunk" else {}
        o2, s2 = mixer(second, rest, output_final_state=True, **kw)
        assert_rel(torch.cat([o1, o2], dim=1), o_full, TOL_F64, f"o, split at {s}")
        assert_rel(s2, s_full, TOL_F64, f"final state, split at {s}")


@pytest.mark.parametrize("mixer", mixer_params(BASIC_MIXERS))
def test_prefill_then_decode_steps(mixer):
    """Chunk prefill of 50 tokens, then 10 single-token recurrent decode steps (T = 1 each),
    chained through the state, == one call over all 60 tokens; also chained uneven chunk pieces."""
    T = 60
    inputs = make_inputs(mixer, B=1, T=T, H=3, K=8, V=5, seed=5)
    o_full, s_full = mixer("recurrent", inputs, output_final_state=True)

    outs = []
    o, state = mixer("chunk", slice_time(inputs, 0, 50), output_final_state=True, chunk_size=16)
    outs.append(o)
    for t in range(50, T):
        o, state = mixer("recurrent", dict(slice_time(inputs, t, t + 1), initial_state=state), output_final_state=True)
        outs.append(o)
    assert_rel(torch.cat(outs, dim=1), o_full, TOL_F64, "prefill + decode o")
    assert_rel(state, s_full, TOL_F64, "prefill + decode state")

    outs, state, start = [], None, 0
    for length in (5, 16, 1, 30, 8):
        piece = dict(slice_time(inputs, start, start + length), initial_state=state)
        o, state = mixer("chunk", piece, output_final_state=True, chunk_size=16)
        outs.append(o)
        start += length
    assert_rel(torch.cat(outs, dim=1), o_full, TOL_F64, "chained pieces o")
    assert_rel(state, s_full, TOL_F64, "chained pieces state")


# ----------------------------------------------------------------------------------------------------
# 3. packed variable-length sequences


LENGTHS = [5, 65, 1, 29, 17]
CU_SEQLENS = torch.tensor([0, 5, 70, 71, 100, 117], dtype=torch.int64)


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("mixer", mixer_params())
def test_cu_seqlens_equals_separate_sequences(mixer, form, with_state):
    """Packed input with cu_seqlens (B = 1) == each sequence run on its own, in o and in every
    sequence's final state (with and without per-sequence initial states)."""
    T, N = int(CU_SEQLENS[-1]), len(LENGTHS)
    inputs = make_inputs(mixer, B=1, T=T, H=2, K=9, V=6, seed=21, initial_state=with_state, N=N)
    kw = {"chunk_size": 16} if form == "chunk" else {}
    o, s = mixer(form, inputs, output_final_state=True, cu_seqlens=CU_SEQLENS, **kw)
    assert o.shape == (1, T, 2, 6)
    for n in range(N):
        a, b = int(CU_SEQLENS[n]), int(CU_SEQLENS[n + 1])
        one = slice_time(inputs, a, b)
        if with_state:
            one["initial_state"] = state_index(inputs["initial_state"], n)
        o_n, s_n = mixer(form, one, output_final_state=True, **kw)
        assert_rel(o[:, a:b], o_n, TOL_F64, f"o of sequence {n}")
        assert_rel(state_index(s, n), s_n, TOL_F64, f"final state of sequence {n}")


def test_cu_seqlens_attention_equals_separate_sequences():
    """attention with cu_seqlens: each packed sequence attends only within itself; the returned state is
    the packed (k, v) as given."""
    torch.manual_seed(0)
    T = int(CU_SEQLENS[-1])
    q, k = torch.randn(1, T, 2, 9, dtype=torch.float64), torch.randn(1, T, 2, 9, dtype=torch.float64)
    v = torch.randn(1, T, 2, 6, dtype=torch.float64)
    o, (k_all, v_all) = attention(q, k, v, cu_seqlens=CU_SEQLENS, output_final_state=True)
    assert torch.equal(k_all, k) and torch.equal(v_all, v)
    for n in range(len(LENGTHS)):
        a, b = int(CU_SEQLENS[n]), int(CU_SEQLENS[n + 1])
        o_n, _ = attention(q[:, a:b], k[:, a:b], v[:, a:b])
        assert_rel(o[:, a:b], o_n, TOL_F64, f"o of sequence {n}")


@pytest.mark.parametrize("mixer", mixer_params(BASIC_MIXERS))
def test_cu_seqlens_chunk_matches_recurrent(mixer):
    """Packed input: the chunk form == the recurrent form (float32, odd chunk size)."""
    inputs = make_inputs(
        mixer, B=1, T=117, H=2, K=9, V=6, dtype=torch.float32, seed=8, initial_state=True, N=len(LENGTHS)
    )
    o_ref, s_ref = mixer("recurrent", inputs, output_final_state=True, cu_seqlens=CU_SEQLENS)
    o, s = mixer("chunk", inputs, output_final_state=True, cu_seqlens=CU_SEQLENS, chunk_size=24)
    assert_rel(o, o_ref, TOL_F32, "o")
    assert_rel(s, s_ref, TOL_F32, "final state")


# ----------------------------------------------------------------------------------------------------
# 5. bfloat16


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("mixer", mixer_params())
def test_bfloat16_inputs(mixer, form):
    """bf16 inputs: finite bf16 output and float32 state, within bf16 tolerance (rel RMS 2e-2) of the
    float32 result on the same (bf16-representable) inputs and of the float32 result on the original
    float32 inputs."""
    inputs32 = make_inputs(mixer, B=2, T=100, H=2, K=32, V=48, dtype=torch.float32, seed=4, initial_state=True)
    inputs16 = cast_inputs(inputs32, torch.bfloat16)
    kw = {"chunk_size": 16} if form == "chunk" else {}
    o16, s16 = mixer(form, inputs16, output_final_state=True, **kw)
    assert o16.dtype == torch.bfloat16 and o16.shape == (2, 100, 2, 48)
    assert torch.isfinite(o16.float()).all()
    for part in s16 if isinstance(s16, tuple) else (s16,):
        assert part.dtype == torch.float32
    o_up, s_up = mixer(form, cast_inputs(inputs16, torch.float32), output_final_state=True, **kw)
    assert_rel(o16, o_up, TOL_BF16, "o vs float32 on bf16-rounded inputs")
    assert_rel(s16, s_up, TOL_BF16, "state vs float32 on bf16-rounded inputs")
    o32, s32 = mixer(form, inputs32, output_final_state=True, **kw)
    assert_rel(o16, o32, TOL_BF16, "o vs float32 inputs")
    assert_rel(s16, s32, TOL_BF16, "state vs float32 inputs")


def test_bfloat16_attention():
    """attention on bf16 inputs: finite bf16 output within bf16 tolerance of the float32 result."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 50, 2, d) for d in (16, 16, 24))
    o16, _ = attention(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert o16.dtype == torch.bfloat16 and torch.isfinite(o16.float()).all()
    o32, _ = attention(q, k, v)
    assert_rel(o16, o32, TOL_BF16, "o")


@pytest.mark.parametrize("mixer", mixer_params(BASIC_MIXERS))
def test_float32_close_to_float64(mixer):
    """The float32 chunk result is within float32 tolerance of the float64 recurrence on the same inputs."""
    inputs = make_inputs(mixer, B=1, T=200, H=2, K=16, V=24, seed=9, initial_state=True)
    o64, s64 = mixer("recurrent", inputs, output_final_state=True)
    inputs32 = {n: (tuple(t.float() for t in x) if isinstance(x, tuple) else x.float()) for n, x in inputs.items()}
    o32, s32 = mixer("chunk", inputs32, output_final_state=True, chunk_size=64)
    assert_rel(o32, o64, tol_for(torch.float32), "o")
    assert_rel(s32, s64, tol_for(torch.float32), "state")
