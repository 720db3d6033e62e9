"""SamplingParams validation: every invalid field raises InvalidRequestError naming it."""
from __future__ import annotations

import pytest

from services.executor.errors import InvalidRequestError
from services.executor.engine.sampling_params import SamplingParams

INVALID = [
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": -3}),
    ("max_tokens", {"max_tokens": 2.0}),
    ("max_tokens", {"max_tokens": "16"}),
    ("max_tokens", {"max_tokens": True}),
    ("temperature", {"temperature": -0.1}),
    ("temperature", {"temperature": "1"}),
    ("temperature", {"temperature": float("nan")}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": -0.5}),
    ("top_p", {"top_p": 1.01}),
    ("top_p", {"top_p": float("nan")}),
    ("top_k", {"top_k": -1}),
    ("top_k", {"top_k": 2.5}),
    ("min_tokens", {"min_tokens": 5, "max_tokens": 4}),
    ("min_tokens", {"min_tokens": -1}),
    ("seed", {"seed": "42"}),
]


@pytest.mark.parametrize(("field", "kwargs"), INVALID, ids=[f"{f}={list(k.values())[0]!r}" for f, k in INVALID])
def test_invalid_field_raises_invalid_request_error_naming_it(field, kwargs):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}:")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"top_p": 1.0},
        {"top_p": 1e-9},
        {"top_k": 0},
        {"max_tokens": 1},
        {"min_tokens": 8, "max_tokens": 8},
        {"seed": 0},
    ],
)
def test_boundary_values_are_accepted(kwargs):
    params = SamplingParams(**kwargs)
    for key, value in kwargs.items():
        assert getattr(params, key) == value


def test_invalid_request_error_is_a_value_error_for_generic_callers():
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)


def test_temperature_zero_means_greedy():
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.1).greedy
