"""The degradation ladder's state machine: hysteresis, dwell, enabled rungs, thresholds,
contracts, and which rung a request is served on given the rungs executors offer."""
from __future__ import annotations

import pytest

from services.scheduler.policy.degradation import (
    DEFAULT_THRESHOLDS, ClassLadder, DegradationContract, DegradationLadder, LadderConfig, LoadSignal, Rung, Thresholds,
    parse_thresholds, served_rung,
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


def test_a_degraded_rung_is_served_only_while_some_executor_offers_it():
    everything = DegradationContract()
    assert served_rung(Rung.KV_COMPRESS, everything) is Rung.NONE  # no degraded pool: full quality
    assert served_rung(Rung.KV_COMPRESS, everything, {Rung.NONE, Rung.KV_COMPRESS}) is Rung.KV_COMPRESS
    assert served_rung(Rung.KV_COMPRESS, everything, {Rung.KV_INT8}) is Rung.KV_INT8  # highest offered below
    assert served_rung(Rung.KV_INT8, everything, {Rung.KV_COMPRESS}) is Rung.NONE  # never above the class's
    assert served_rung(Rung.SMALLER_MODEL, everything, {Rung.KV_INT8, Rung.KV_COMPRESS}) is Rung.KV_COMPRESS
    assert served_rung(Rung.NONE, everything, {Rung.KV_INT8}) is Rung.NONE


def test_served_rung_is_the_highest_rung_the_contract_accepts_and_shed_always_applies():
    offered = {Rung.KV_INT8, Rung.KV_COMPRESS, Rung.SMALLER_MODEL}
    int8_only = DegradationContract.from_labels(["kv_int8"])
    assert served_rung(Rung.SMALLER_MODEL, int8_only, offered) is Rung.KV_INT8
    assert served_rung(Rung.KV_INT8, DegradationContract.from_labels(["kv_compress"]), offered) is Rung.NONE
    assert served_rung(Rung.SMALLER_MODEL, DegradationContract.from_labels(["none"]), offered) is Rung.NONE
    assert served_rung(Rung.SHED, DegradationContract.from_labels(["none"])) is Rung.SHED
    assert int8_only.accepted == {Rung.NONE, Rung.KV_INT8, Rung.SHED}
    assert DegradationContract.from_labels([]) == DegradationContract()  # none listed: every rung


def test_a_degrade_fallback_takes_the_least_degraded_accepted_rung_on_offer():
    offered = {Rung.NONE, Rung.KV_COMPRESS, Rung.SMALLER_MODEL, Rung.SHED}
    assert DegradationContract().lowest_offered(offered) is Rung.KV_COMPRESS
    assert DegradationContract.from_labels(["smaller_model"]).lowest_offered(offered) is Rung.SMALLER_MODEL
    assert DegradationContract.from_labels(["kv_int8"]).lowest_offered(offered) is None
    assert DegradationContract().lowest_offered({Rung.NONE}) is None


def test_an_enter_threshold_of_zero_pins_the_class_on_the_rung():
    clock = Clock()
    thresholds = parse_thresholds("kv_int8=0:0")
    ladder = ClassLadder(LadderConfig(enabled=frozenset({Rung.NONE, Rung.KV_INT8, Rung.SHED}),
                                      thresholds=thresholds, min_dwell_s=0), clock)
    assert ladder.observe(load(0.0)) is Rung.KV_INT8
    clock.now = 100.0
    assert ladder.observe(load(0.0)) is Rung.KV_INT8  # never left
    assert ladder.observe(load(1.0)) is Rung.SHED  # the rungs above still act on load
    assert ladder.observe(load(0.0)) is Rung.KV_INT8


def test_thresholds_parse_over_the_defaults_and_bad_items_are_named():
    parsed = parse_thresholds(" shed=0.9:0.7 ")
    assert parsed[Rung.SHED] == Thresholds(enter=0.9, exit=0.7)
    assert parsed[Rung.KV_INT8] == DEFAULT_THRESHOLDS[Rung.KV_INT8]
    for bad in ("kv_int8=0.5", "turbo=0.5:0.1", "kv_int8=0.3:0.5", "none=0.5:0.1", "shed=x:0.1"):
        with pytest.raises(ValueError, match="degradation threshold"):
            parse_thresholds(bad)


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


def test_kv_pressure_drives_the_quality_rungs_but_only_admission_sheds():
    clock = Clock()
    ladder = ClassLadder(LadderConfig(enabled=ALL, min_dwell_s=0), clock)
    full_kv = LoadSignal(admission_fraction=0.1, kv_used_fraction=1.0)
    seen = [ladder.observe(full_kv) for _ in range(5)]
    assert seen == [Rung.KV_INT8, Rung.KV_COMPRESS, Rung.SMALLER_MODEL, Rung.SMALLER_MODEL, Rung.SMALLER_MODEL]
    assert ladder.observe(LoadSignal(admission_fraction=0.99, kv_used_fraction=1.0)) is Rung.SHED
    # off shed as soon as admission falls below shed's exit, even with the KV pool still full
    assert ladder.observe(full_kv) is Rung.SMALLER_MODEL
    # a mesh with no degraded pool: a full KV pool alone never refuses work
    only_shed = ClassLadder(LadderConfig(), clock)
    assert {only_shed.observe(full_kv) for _ in range(5)} == {Rung.NONE}
