"""Property-based: for any shape hypothesis draws, the chunk form equals the recurrence (float64)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .helpers import BASIC_MIXERS, TOL_F64, assert_rel, make_inputs, mixer_params

shapes = st.fixed_dictionaries(
    {
        "B": st.integers(1, 2),
        "T": st.integers(1, 90),
        "H": st.integers(1, 3),
        "K": st.integers(1, 17),
        "V": st.integers(1, 17),
        "chunk_size": st.integers(1, 40),
        "initial_state": st.booleans(),
        "seed": st.integers(0, 2**16),
    }
)


@pytest.mark.parametrize("mixer", mixer_params(BASIC_MIXERS))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=shapes)
def test_chunk_equals_recurrent_any_shape(mixer, shape):
    """Any B, T, H, K, V and chunk size (including C = 1, C > T, C not dividing T), with or without an
    initial state: o and the final state of the chunk form match the recurrence to 1e-9."""
    shape = dict(shape)
    C = shape.pop("chunk_size")
    x = make_inputs(mixer, dtype=torch.float64, **shape)
    o_ref, s_ref = mixer("recurrent", x, output_final_state=True)
    o, s = mixer("chunk", x, output_final_state=True, chunk_size=C)
    assert_rel(o, o_ref, TOL_F64, f"o, {shape}, C={C}")
    if isinstance(s, tuple):
        for part, part_ref in zip(s, s_ref):
            assert_rel(part, part_ref, TOL_F64, f"state, {shape}, C={C}")
    else:
        assert_rel(s, s_ref, TOL_F64, f"state, {shape}, C={C}")
