"""A fuzzer for `TrainConfig` (issue 60): any value of any field, of any type — a list, a path, NaN, a
huge integer, an empty string, a size written as text — either makes a config or is refused with one
ValueError that names the field; never a TypeError from deeper code, never an accepted value of the
wrong kind."""

from __future__ import annotations

import dataclasses
import math
import pathlib

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3.training import TrainConfig

FIELDS = [f.name for f in dataclasses.fields(TrainConfig)]
ODD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", " ", "1GiB", "nan", "runs/x", "bf16", "muon", "wsd", "kimi-k3-tiny", "\x00"]),
    st.lists(st.integers(0, 3), max_size=3),
    st.just([pathlib.Path("corpus.txt")]),
    st.just(pathlib.Path("runs/fuzz")),
    st.dictionaries(st.sampled_from(["hidden_size", "num_layers", "nope"]), st.integers(-2, 64), max_size=2),
    st.tuples(st.floats(0, 1), st.floats(0, 1)),
)
DEFAULTS = TrainConfig()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(FIELDS), value=ODD)
def test_any_value_of_any_field_is_taken_or_refused_naming_it(name, value):
    try:
        cfg = TrainConfig(**{name: value})
    except ValueError as e:
        assert name in str(e) or "model_overrides" in str(e) or "preset" in str(e), str(e)
        assert "\n" not in str(e)
        return
    got = getattr(cfg, name)
    default = getattr(DEFAULTS, name)
    if isinstance(default, bool):
        assert isinstance(got, bool)
    elif isinstance(default, (int, float)) and not isinstance(default, bool):
        assert got is None or (isinstance(got, (int, float)) and not isinstance(got, bool) and math.isfinite(got)), got
    elif name in ("data", "out"):
        assert got is None or (isinstance(got, str) and got.strip()), got
    elif isinstance(default, str) and name not in ("data",):
        assert isinstance(got, str), got
