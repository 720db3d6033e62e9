"""`weft top` rendering from scraped samples (no mesh): quantiles from histogram buckets,
KV per partition, tier hit rates, latency by class, the verdict; a down service."""
from __future__ import annotations

from weft.cli.top import ServiceView, Snapshot, histogram_quantile, latency_by_class, parse_metrics, render

ROUTER = """
# TYPE weft_ttft_seconds histogram
weft_ttft_seconds_bucket{le="0.1",request_class="interactive",tenant="a"} 90
weft_ttft_seconds_bucket{le="1.0",request_class="interactive",tenant="a"} 100
weft_ttft_seconds_bucket{le="+Inf",request_class="interactive",tenant="a"} 100
weft_ttft_seconds_count{request_class="interactive",tenant="a"} 100
weft_ttft_seconds_sum{request_class="interactive",tenant="a"} 5
# TYPE weft_e2e_seconds histogram
weft_e2e_seconds_bucket{le="0.5",request_class="interactive",tenant="a"} 50
weft_e2e_seconds_bucket{le="2.5",request_class="interactive",tenant="a"} 100
weft_e2e_seconds_bucket{le="+Inf",request_class="interactive",tenant="a"} 100
weft_e2e_seconds_count{request_class="interactive",tenant="a"} 100
weft_e2e_seconds_sum{request_class="interactive",tenant="a"} 60
# TYPE weft_router_in_flight_requests gauge
weft_router_in_flight_requests{api="http"} 3
"""
EXECUTOR = """
# TYPE weft_kv_blocks gauge
weft_kv_blocks{executor="executor-0",partition="default",state="used"} 30
weft_kv_blocks{executor="executor-0",partition="default",state="reserved"} 0
weft_kv_blocks{executor="executor-0",partition="default",state="borrowed"} 30
weft_kv_blocks{executor="executor-0",partition="acme",state="used"} 10
weft_kv_blocks{executor="executor-0",partition="acme",state="reserved"} 16
weft_kv_blocks{executor="executor-0",partition="acme",state="borrowed"} 0
# TYPE weft_kv_pool_blocks gauge
weft_kv_pool_blocks{executor="executor-0",state="total"} 64
weft_kv_pool_blocks{executor="executor-0",state="free"} 24
# TYPE weft_kv_lookup_tokens counter
weft_kv_lookup_tokens_total{result="hit",tier="active"} 250
weft_kv_lookup_tokens_total{result="miss",tier="active"} 750
"""
VERDICT = {"cause": "kv_contention", "explanation": "requests wait for KV blocks", "num_requests": 200, "num_tail": 2,
           "p50_ms": 120.0, "p99_ms": 900.0, "tail_ms": {"kv_contention": 700.0, "decode": 150.0, "migration": 0.0},
           "baseline_ms": {}}


def test_histogram_quantile_interpolates_within_the_bucket_like_prometheus():
    buckets = [(0.1, 90.0), (1.0, 100.0), (float("inf"), 100.0)]
    assert abs(histogram_quantile(0.5, buckets) - 0.1 * 50 / 90) < 1e-9
    assert abs(histogram_quantile(0.99, buckets) - (0.1 + 0.9 * 9 / 10)) < 1e-9
    assert histogram_quantile(0.5, [(1.0, 0.0), (float("inf"), 0.0)]) is None


def test_latency_by_class_sums_tenants():
    samples = parse_metrics(ROUTER + ROUTER.replace('tenant="a"', 'tenant="b"').replace("# TYPE", "# IGNORED"))
    count, p50, p99 = latency_by_class(samples, "weft_e2e_seconds")["interactive"]
    assert count == 200 and abs(p50 - 0.5) < 1e-9 and 0.5 < p99 <= 2.5


def test_a_frame_shows_services_kv_partitions_tiers_latency_and_the_verdict():
    snap = Snapshot(0.0, [
        ServiceView("router", "router", 11, True, parse_metrics(ROUTER)),
        ServiceView("executor-0", "executor", 12, True, parse_metrics(EXECUTOR)),
        ServiceView("scheduler", "scheduler", 13, False),
    ], VERDICT)
    screen = render(snap)
    assert "2/3 services up" in screen and "DOWN" in screen
    assert "streaming 3" in screen
    kv = {line.split()[1]: line.split() for line in screen.splitlines() if line.strip().startswith("executor-0")}
    assert kv["default"][2:5] == ["30", "0", "30"] and kv["acme"][2:5] == ["10", "16", "0"]
    assert "40/64 blocks" in screen
    assert "active 25% of 1000 tokens" in screen
    assert "interactive" in screen and "56ms" in screen  # TTFT p50 (0.1 s * 50/90)
    assert "KV_CONTENTION: requests wait for KV blocks" in screen
    assert "kv_contention 700ms  decode 150ms" in screen and "migration" not in screen.split("tail:")[-1]


def test_an_empty_window_says_so():
    screen = render(Snapshot(0.0, [], None))
    assert "(no finished requests in the window)" in screen


def test_the_ladder_line_names_each_class_rung_from_the_scheduler_gauge():
    scheduler = """
# TYPE weft_degradation_rung gauge
weft_degradation_rung{request_class="interactive"} 0
weft_degradation_rung{request_class="batch"} 1
weft_degradation_rung{request_class="agentic"} 4
"""
    frame = render(Snapshot(0.0, [ServiceView("scheduler", "scheduler", 13, True, parse_metrics(scheduler))], None))
    assert "LADDER      agentic shed   batch kv_int8   interactive none" in frame
    assert "(no class observed yet)" in render(Snapshot(0.0, [ServiceView("scheduler", "scheduler", 13, True)], None))
