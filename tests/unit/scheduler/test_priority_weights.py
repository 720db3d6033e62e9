"""``--priority-weights``: the weft policy's term weights, from a flag and live."""
from __future__ import annotations

import dataclasses

import pytest

from services.mesh.live_settings import LIVE_SETTINGS
from services.scheduler.config import SchedulerConfig
from services.scheduler.policy.priority import (
    PriorityInputs,
    WeftPrioritizer,
    WeftWeights,
    parse_priority_weights,
)
from services.shared.vocabulary import RequestClass


def test_weights_override_the_defaults_one_by_one():
    assert parse_priority_weights("") == WeftWeights()
    assert parse_priority_weights(" las=0.25 , aging_s=10") == dataclasses.replace(WeftWeights(), las=0.25, aging_s=10)


@pytest.mark.parametrize("text, names", [
    ("lass=1", "'lass=1'"), ("las", "'las'"), ("las=x", "'x'"), ("slack=-1", ">= 0"), ("aging_s=0", "aging_s > 0"),
    ("entropy=nan", ">= 0"),
])
def test_bad_weights_are_refused_naming_the_item(text, names):
    with pytest.raises(ValueError, match="priority_weights") as err:
        SchedulerConfig(priority_weights=text)
    assert names in str(err.value)
    assert LIVE_SETTINGS["scheduler"]["priority_weights"](text) is not None  # the admin API refuses it too


def test_a_zero_las_weight_no_longer_sinks_a_long_program():
    long_program = PriorityInputs(arrival_s=0.0, request_class=RequestClass.AGENTIC, attained_tokens=50_000)
    fresh_program = PriorityInputs(arrival_s=0.0, request_class=RequestClass.AGENTIC, attained_tokens=0)
    default = WeftPrioritizer()
    assert default.priority(long_program, 1.0) < default.priority(fresh_program, 1.0)
    flat = WeftPrioritizer(parse_priority_weights("las=0"))
    assert flat.priority(long_program, 1.0) == flat.priority(fresh_program, 1.0)
    assert LIVE_SETTINGS["scheduler"]["priority_weights"]("las=0") is None
