"""The degradation ladder's state machine: hysteresis, dwell, enabled rungs, contracts."""
from __future__ import annotations

import pytest

from services.scheduler.degradation import (
    ClassLadder, DegradationContract, DegradationLadder, LadderConfig, LoadSignal, Rung, Thresholds, served_rung,
)

ALL = frozenset(Rung)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def load(x: float) -> LoadSignal:
    return LoadSignal(admission_fraction=x)


def test_load_climbs_one_rung_per_observation_through_every_enabled_rung():
    ladder = ClassLadder(LadderConfig(enabled=ALL), Clock())
    seen = [ladder.observe(load(0.99)) for _ in range(5)]
    assert seen == [Rung.KV_INT8, Rung.KV_COMPRESS, Rung.SMALLER_MODEL, Rung.SHED, Rung.SHED]


def test_load_between_exit_and_enter_keeps_the_rung_in_both_directions():
    clock = Clock()
    ladder = ClassLadder(LadderConfig(min_dwell_s=0), clock)  # none, shed: enter 0.95, exit 0.75
    assert ladder.observe(load(0.9)) is Rung.NONE  # below enter: stays down
    assert ladder.observe(load(0.95)) is Rung.SHED
    for x in (0.9, 0.8, 0.76, 0.94):  # hovering in the band never flaps
        assert ladder.observe(load(x)) is Rung.SHED
    assert ladder.observe(load(0.74)) is Rung.NONE


def test_leaving_a_rung_waits_for_the_dwell_time():
    clock = Clock()
    ladder = ClassLadder(LadderConfig(min_dwell_s=2.0), clock)
    ladder.observe(load(1.0))
    clock.now = 1.0
    assert ladder.observe(load(0.0)) is Rung.SHED
    clock.now = 2.5
    assert ladder.observe(load(0.0)) is Rung.NONE


def test_disabled_rungs_are_skipped():
    ladder = ClassLadder(LadderConfig(enabled=frozenset({Rung.NONE, Rung.KV_INT8, Rung.SHED})), Clock())
    assert [ladder.observe(load(1.0)) for _ in range(3)] == [Rung.KV_INT8, Rung.SHED, Rung.SHED]


def test_classes_move_independently():
    ladder = DegradationLadder(LadderConfig(min_dwell_s=0), Clock())
    ladder.observe("batch", load(1.0))
    ladder.observe("interactive", load(0.1))
    assert ladder.rungs() == {"batch": Rung.SHED, "interactive": Rung.NONE}


def test_served_rung_respects_the_contract_and_what_acts_today():
    everything = DegradationContract()
    assert served_rung(Rung.KV_COMPRESS, everything) is Rung.NONE  # not acting yet: served at full quality
    assert served_rung(Rung.SHED, DegradationContract.from_labels(["none"])) is Rung.SHED
    assert served_rung(Rung.NONE, everything) is Rung.NONE
    assert DegradationContract.from_labels(["kv_int8"]).accepted == {Rung.NONE, Rung.KV_INT8, Rung.SHED}


def test_config_is_validated():
    with pytest.raises(ValueError):
        Thresholds(enter=0.5, exit=0.6)
    with pytest.raises(ValueError):
        LadderConfig(enabled=frozenset({Rung.SHED}))
    with pytest.raises(ValueError):
        Rung.parse("turbo")
    assert Rung.parse(" KV_int8") is Rung.KV_INT8


def test_load_signal_is_the_worse_of_admission_and_kv():
    assert LoadSignal(admission_fraction=0.2, kv_used_fraction=0.9).load == 0.9
