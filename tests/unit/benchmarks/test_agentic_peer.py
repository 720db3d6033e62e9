"""The pure parts of `weft bench agentic --peer llama-server`: the workload is deterministic
and shaped as issue 17 says, and the ratio / geomean / target tables compute what they claim."""
from __future__ import annotations

import math

import pytest

from benchmarks import agentic_peer_report as rep
from benchmarks.agentic_workload import PeerWorkloadSpec, make_peer_workload

SPEC = PeerWorkloadSpec()


def test_same_seed_same_workload_other_seed_differs():
    a = make_peer_workload(SPEC, 3, 32000, 4000)
    assert a == make_peer_workload(SPEC, 3, 32000, 4000)
    assert a != make_peer_workload(SPEC, 4, 32000, 4000)


def test_programs_have_3_to_16_hops_with_a_tail_and_fit_the_context():
    hops = []
    for seed in range(20):
        programs, _ = make_peer_workload(SPEC, seed, 32000, 4000)
        assert len(programs) == SPEC.num_programs
        for p in programs:
            assert SPEC.min_hops <= len(p.hops) <= SPEC.max_hops
            assert sum(len(h.new_token_ids) for h in p.hops) + len(p.prefix_token_ids) \
                + len(p.hops) * SPEC.output_tokens <= 4000
            assert p.hops[-1].pause_s == 0 and all(h.pause_s > 0 for h in p.hops[:-1])
            hops.append(len(p.hops))
    assert sorted(hops)[len(hops) // 2] <= 6  # most programs are short ...
    assert max(hops) == SPEC.max_hops  # ... and the tail reaches the cap


def test_tool_pauses_are_log_normal_around_the_median_and_chats_arrive_at_the_rate():
    programs, chats = make_peer_workload(SPEC, 0, 32000, 4000)
    pauses = sorted(h.pause_s for p in programs for h in p.hops[:-1])
    assert 0.3 < pauses[len(pauses) // 2] < 0.8
    rate = len(chats) / chats[-1].start_s
    assert 0.85 < rate < 1.15
    assert all(a.start_s < b.start_s for a, b in zip(chats, chats[1:]))


def test_hop_count_never_exceeds_the_context_even_with_a_small_one():
    programs, _ = make_peer_workload(SPEC, 1, 32000, 700)
    assert all(len(p.hops) >= 1 for p in programs)
    assert all(len(p.prefix_token_ids) + sum(len(h.new_token_ids) + SPEC.output_tokens for h in p.hops) <= 700
               for p in programs)


def test_bad_spec_is_refused():
    with pytest.raises(ValueError):
        PeerWorkloadSpec(min_hops=5, max_hops=4)
    with pytest.raises(ValueError):
        PeerWorkloadSpec(concurrency=0)


def _run(config, seed, jct_p99, ttft_p99):
    return rep.RunSummary(config, seed, 1.0, jct_p99, 10.0, ttft_p99, 50.0, 24, 30, 0, 60.0)


RUNS = [_run(rep.PEER, 0, 20.0, 800.0), _run(rep.HINTS, 0, 10.0, 100.0), _run(rep.NO_HINTS, 0, 16.0, 400.0),
        _run(rep.PEER, 1, 18.0, 900.0), _run(rep.HINTS, 1, 20.0, 300.0), _run(rep.NO_HINTS, 1, 20.0, 1000.0)]


def test_ratio_is_per_seed_and_geomean_is_geometric():
    r = rep.ratio(RUNS, rep.PEER, rep.HINTS, "jct_p99_s")
    assert r.per_seed == (2.0, 0.9)
    assert r.geomean == pytest.approx(math.sqrt(1.8))
    assert rep.geomean([4.0, 1.0]) == pytest.approx(2.0)  # the arithmetic mean would be 2.5


def test_ratio_skips_seeds_missing_a_config():
    runs = RUNS + [_run(rep.PEER, 2, 5.0, 5.0)]
    assert len(rep.ratio(runs, rep.PEER, rep.HINTS, "jct_p99_s").per_seed) == 2


def test_targets_use_geomean_and_the_worst_seed_for_never_below():
    t = {x.text: x for x in rep.targets(RUNS)}
    jct = t["Weft with hints vs llama-server, program completion p99"]
    assert not jct.met  # geomean sqrt(1.8) = 1.34 < 1.5
    ttft = t["Weft with hints vs llama-server, interactive TTFT p99"]
    assert ttft.met and ttft.value == pytest.approx(math.sqrt(8 * 3))
    never = t["Weft without hints vs llama-server, interactive TTFT p99 (worst seed)"]
    assert never.value == pytest.approx(0.9) and not never.met  # geomean 1.34 would pass; the worst seed fails


def test_percentile_is_nearest_rank_and_median_range_formats():
    assert rep.pct(list(range(1, 25)), 99) == 24
    assert rep.pct([3.0, 1.0, 2.0], 50) == 2.0
    assert math.isnan(rep.pct([], 50))
    assert rep.median_range([3.0, 1.0, 2.0], ".1f") == "2.0 [1.0–3.0]"


def test_section_replaces_only_between_markers():
    doc = "# Agentic benchmark\n\nold intro\n"
    once = rep.splice_section(doc, "## Peer\nfirst")
    assert once.startswith("# Agentic benchmark\n") and "old intro" in once and "first" in once
    twice = rep.splice_section(once + "\n## Older section\nkept\n", "## Peer\nsecond")
    assert "second" in twice and "first" not in twice and "kept" in twice and "old intro" in twice
    assert twice.count(rep.markers("peer")[0]) == 1


def test_a_model_subsection_is_replaced_alone_inside_the_peer_section():
    outer = rep.splice_section("## Against llama-server", "### bench\nb1", key="peer-bench", at_end=True)
    outer = rep.splice_section(outer, "### smollm2\ns1", key="peer-smollm2", at_end=True)
    outer = rep.splice_section(outer, "### bench\nb2", key="peer-bench", at_end=True)
    assert "b2" in outer and "b1" not in outer and "s1" in outer
    assert outer.index("bench") < outer.index("smollm2")  # kept in place
    doc = rep.splice_section("# Agentic benchmark\n\nold\n", outer)
    assert rep.section_text(doc) == outer.strip("\n") and doc.endswith("old\n")
