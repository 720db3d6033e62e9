import pytest

from services.scheduler.policy.placement import (
    Candidate, InflightTracker, KvAwarePlacer, LeastLoadedPlacer, PlacementPolicy, RoundRobinPlacer, make_placer,
)


def cand(name, matched=0, prompt=10, used=0, active=0, num_blocks=1000, max_num_seqs=64) -> Candidate:
    return Candidate(name=name, address=f"{name}:1", num_prompt_blocks=prompt, num_matched_blocks=matched,
                     num_used_blocks=used, num_blocks=num_blocks, num_active_requests=active,
                     max_num_seqs=max_num_seqs)


def test_prefix_holder_wins_under_equal_load():
    ranked = KvAwarePlacer().rank([cand("a"), cand("b", matched=8)])
    assert ranked[0].name == "b" and ranked[0].num_matched_blocks == 8


def test_prefix_holder_wins_when_its_extra_load_is_less_than_the_prefill_saved():
    ranked = KvAwarePlacer().rank([cand("a", used=0), cand("b", matched=8, used=7)])
    assert ranked[0].name == "b"


def test_overloaded_prefix_holder_loses():
    ranked = KvAwarePlacer().rank([cand("a", used=0), cand("b", matched=8, used=50)])
    assert ranked[0].name == "a"


def test_full_prefix_holder_loses_even_with_a_full_match():
    no_slot = cand("b", matched=10, active=64, max_num_seqs=64)
    no_room = cand("c", matched=2, used=995, num_blocks=1000)
    ranked = KvAwarePlacer().rank([cand("a", used=30), no_slot, no_room])
    assert ranked[0].name == "a"


def test_overlap_weight_zero_ignores_the_prefix():
    ranked = KvAwarePlacer(overlap_weight=0.0).rank([cand("a", used=1), cand("b", matched=10, used=2)])
    assert ranked[0].name == "a"


def test_ties_break_by_active_requests_then_name():
    assert KvAwarePlacer().rank([cand("b"), cand("a")])[0].name == "a"
    assert KvAwarePlacer().rank([cand("a", active=2), cand("b", active=1)])[0].name == "b"


def test_round_robin_rotates_over_executors():
    placer = RoundRobinPlacer()
    firsts = [placer.rank([cand("a"), cand("b"), cand("c")])[0].name for _ in range(4)]
    assert firsts == ["a", "b", "c", "a"]
    assert placer.rank([]) == []


def test_least_loaded_prefers_free_sequence_slots():
    ranked = LeastLoadedPlacer().rank([cand("a", active=10, matched=10), cand("b", active=2)])
    assert [p.name for p in ranked] == ["b", "a"]


def test_factory_builds_each_policy_from_its_flag_value():
    assert isinstance(make_placer(PlacementPolicy("kv")), KvAwarePlacer)
    assert isinstance(make_placer(PlacementPolicy("round_robin")), RoundRobinPlacer)
    assert isinstance(make_placer(PlacementPolicy("least_loaded")), LeastLoadedPlacer)
    with pytest.raises(ValueError):
        PlacementPolicy("random")


def test_inflight_tracker_counts_requests_and_blocks_per_executor():
    t = InflightTracker()
    t.start("a", "r1", 3)
    t.start("a", "r2", 2)
    t.update("a", "r1", 4)
    assert (t.num_requests("a"), t.num_blocks("a")) == (2, 6)
    t.finish("a", "r1")
    t.finish("a", "r2")
    t.finish("a", "r2")
    assert (t.num_requests("a"), t.num_blocks("a")) == (0, 0)
