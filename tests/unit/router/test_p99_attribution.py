"""p99 attribution on synthetic timelines: the verdict names the component the tail
pays for (queueing when admission is saturated, KV contention when the pool is)."""
from __future__ import annotations

import random

from services.mesh import metric_catalogue as catalogue
from services.mesh.timeline import Span
from services.router.attribution import COMPONENTS, Attribution, breakdown, verdict_of

MS = 1_000_000


def timeline(rid: str, *, queue_ms=1.0, wait_ms=0.5, kv_blocked_share=0.0, preempted_ms=0.0, prefill_ms=10.0,
             decode_ms=40.0, overhead_ms=2.0, extra: tuple[tuple[str, float], ...] = ()) -> list[Span]:
    """A router → scheduler → executor timeline with the given phase lengths (ms)."""
    spans, t = [], 0

    def add(name: str, service: str, start: float, dur: float, **attrs) -> None:
        spans.append(Span("t" * 32, f"{len(spans):016x}", "", name, service, int(start * MS), int((start + dur) * MS),
                          attrs))

    t = overhead_ms / 2
    add("scheduler.queue", "scheduler", t, queue_ms)
    t += queue_ms
    add("executor.wait", "executor", t, wait_ms, kv_blocked_ms=wait_ms * kv_blocked_share,
        queued_ms=wait_ms * (1 - kv_blocked_share))
    t += wait_ms
    add("executor.prefill", "executor", t, prefill_ms + preempted_ms)
    if preempted_ms:
        add("executor.preempted", "executor", t + prefill_ms / 2, preempted_ms)
    t += prefill_ms + preempted_ms
    add("executor.decode", "executor", t, decode_ms)
    t += decode_ms
    for name, dur in extra:
        add(name, "scheduler", t, dur)
        t += dur
    add("router.request", "router", 0, t + overhead_ms / 2)
    return spans


def many(n: int, seed: int = 0, **slow) -> list:
    """n ordinary requests (jittered) and, when ``slow`` is given, 3 % slow ones."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        kw = dict(prefill_ms=10 * rng.uniform(0.8, 1.2), decode_ms=40 * rng.uniform(0.8, 1.2))
        if slow and i % 33 == 0:
            kw.update(slow)
        items.append(breakdown(f"r{i}", timeline(f"r{i}", **kw), now_s=1000.0))
    return items


def test_components_add_up_to_end_to_end_latency():
    b = breakdown("r", timeline("r", queue_ms=5, wait_ms=4, kv_blocked_share=0.5, preempted_ms=6))
    assert abs(sum(b.parts.values()) - b.e2e_s) < 1e-9
    assert abs(b.parts["kv_contention"] - 0.008) < 1e-9  # half the executor wait + the preempted time
    assert abs(b.parts["queueing"] - 0.007) < 1e-9  # scheduler queue + the other half of the wait
    assert abs(b.parts["prefill"] - 0.010) < 1e-9  # preempted time taken out of the prefill span


def test_verdict_names_queueing_when_the_admission_queue_is_saturated():
    v = verdict_of(many(300, queue_ms=900))
    assert v.cause == "queueing"
    assert v.tail_s["queueing"] > 0.5 and v.p99_s > 0.9


def test_verdict_names_kv_contention_when_the_pool_is_saturated():
    v = verdict_of(many(300, wait_ms=300, kv_blocked_share=1.0, preempted_ms=400))
    assert v.cause == "kv_contention"


def test_verdict_tells_executor_queueing_from_kv_blocking_by_the_wait_split():
    assert verdict_of(many(300, wait_ms=800, kv_blocked_share=0.0)).cause == "queueing"
    assert verdict_of(many(300, wait_ms=800, kv_blocked_share=0.9)).cause == "kv_contention"


def test_verdict_names_long_prompts_and_future_causes():
    assert verdict_of(many(300, prefill_ms=700)).cause == "prefill"
    assert verdict_of(many(300, extra=(("scheduler.migration", 600),))).cause == "migration"
    assert verdict_of(many(300, extra=(("executor.tier_fetch", 600),))).cause == "tier_miss"


def test_a_component_every_request_pays_equally_is_not_the_verdict():
    # Every request decodes ~40 ms (the largest part), but only the tail queues.
    v = verdict_of(many(300, queue_ms=120))
    assert v.tail_s["decode"] > 0.03 and v.cause == "queueing"


def test_incomplete_timelines_are_left_out_and_an_empty_window_has_no_cause():
    router_only = [s for s in timeline("r") if s.service == "router"]
    assert breakdown("r", router_only) is None
    a = Attribution()
    assert a.observe("r", router_only) is None
    assert a.verdict().cause is None


def test_window_drops_requests_older_than_its_age_and_exports_one_cause():
    a = Attribution(max_age_s=60)
    for b in many(50, queue_ms=900):
        a._items.append(b)  # finished at t=1000 s
    assert a.verdict(now_s=1030, max_age_s=10).num_requests == 0
    assert a.verdict(now_s=1030).cause == "queueing"
    flags = {c: catalogue.metric("weft_p99_verdict").labels(c)._value.get() for c in COMPONENTS}
    assert flags["queueing"] == 1 and sum(flags.values()) == 1
    assert a.verdict(now_s=2000).num_requests == 0


def test_a_tenants_verdict_covers_its_requests_and_leaves_the_operator_gauges_alone():
    a = Attribution()
    for i in range(4):
        a.observe(f"a/r{i}", timeline(f"r{i}", prefill_ms=500), tenant="a")
        a.observe(f"b/r{i}", timeline(f"r{i}", queue_ms=900), tenant="b")
    everyone = a.verdict()
    assert everyone.num_requests == 8
    flags = lambda: {c: catalogue.metric("weft_p99_verdict").labels(c)._value.get() for c in COMPONENTS}  # noqa: E731
    exported = flags()
    only_a = a.verdict(tenant="a")
    assert only_a.num_requests == 4 and only_a.cause == "prefill"
    assert a.verdict(tenant="b").cause == "queueing"
    assert a.verdict(tenant="nobody").num_requests == 0
    assert flags() == exported  # the metrics port keeps the all-tenant view
