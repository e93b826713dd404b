"""`SamplingParams` fuzzed: every field with wrong types, NaN, +-inf, huge and negative values gives
a ValueError that names the field; valid values construct."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weft import SamplingParams
from weft.params import FLOAT_FIELDS

BAD_NUMBERS = [math.nan, math.inf, -math.inf, 10**400, "1", None, [1], True]

# field -> values that must be rejected
BAD = {
    "n": [0, -1, 1.5, "2", None, True, 10**30 * 1.0],
    "temperature": [-0.1, *BAD_NUMBERS],
    "top_p": [0.0, 1.01, -1.0, *BAD_NUMBERS],
    "top_k": [-2, 1.5, "3", None, math.nan],
    "min_p": [-0.1, 1.1, *BAD_NUMBERS],
    "repetition_penalty": [0.0, -1.0, *BAD_NUMBERS],
    "presence_penalty": [2.5, -2.5, *BAD_NUMBERS],
    "frequency_penalty": [2.5, -2.5, *BAD_NUMBERS],
    "seed": [2**63, 2**70, -(2**63) - 1, 1.5, "1", math.inf, True],
    "max_tokens": [0, -5, 1.5, "10", math.inf],
    "min_tokens": [-1, 1.5, None, "0"],
    "stop": ["", [""], [1], "a\ud800", ["ok", "\udfff"], 5, {"a": 1}],
    "stop_token_ids": [[-1], [1.5], ["3"], 7, [True], [2**64]],
    "logprobs": [-1, 1.5, "5", math.inf],
    "logprobs_mode": ["cooked", 3, None],
    "output_kind": ["everything", 1],
    "ignore_eos": [1, "yes", None],
    "fast_forward": [0, "no"],
    "logits_processors": [[1], 5, ["f"]],
    "regex": ["", 5, "\ud800"],
    "grammar": ["   ", 3, "\ud800 ::= x"],
    "choice": [[], [""], "abc", [1, 2], ["\ud800"]],
    "json_schema": [5, "{not json", [1, 2]],
    "grammar_syntax": ["yacc", 2],
}


@pytest.mark.parametrize(("field", "value"), [(f, v) for f, values in BAD.items() for v in values])
def test_bad_values_name_their_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)


def test_seed_range_leaves_room_for_n_samples():
    SamplingParams(seed=2**63 - 5, n=4)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**63 - 2, n=4)


ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
    st.lists(st.one_of(st.integers(-5, 5), st.text(max_size=3)), max_size=3),
)


@settings(max_examples=400, deadline=None)
@given(field=st.sampled_from(sorted(BAD)), value=ANY_VALUE)
def test_any_value_constructs_or_names_the_field(field, value):
    """Whatever is given, the only possible failure is a ValueError naming the field (or, for the
    constraint fields, the one that conflicts), never a TypeError or OverflowError from deeper."""
    try:
        params = SamplingParams(**{field: value})
    except ValueError as exc:
        assert field in str(exc) or "output constraint" in str(exc), str(exc)
        return
    for name in FLOAT_FIELDS:
        assert math.isfinite(getattr(params, name))
    assert params.seed is None or -(2**63) <= params.seed < 2**63


def test_valid_values_construct():
    params = SamplingParams(
        n=2,
        temperature=0,
        top_p=1,
        top_k=-1,
        min_p=0,
        seed=-5,
        stop="x",
        stop_token_ids=[1, 2],
        logprobs=0,
        logprobs_mode="processed",
        output_kind="delta",
        choice=("a", "b"),
    )
    assert params.temperature == 0.0 and isinstance(params.temperature, float)
    assert params.stop == ("x",) and params.stop_token_ids == (1, 2) and params.top_k == 0
