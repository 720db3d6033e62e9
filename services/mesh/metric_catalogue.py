"""The one metric catalogue of the mesh: every ``weft_*`` metric that explains latency
and memory, with its type, labels and help, and the one function each event calls.

NOTE: services never construct these metrics themselves. They call ``register(service)``
once at start (so every metric they own is exported, even before its first event) and
then the small recording functions below at the place the event happens. A metric whose
feature has not landed yet is still declared here with ``waits_for`` naming the issue,
so dashboards and ``weft top`` can already be written against it. ``docs/metrics.md``
is this table in prose; a test keeps the two in step.

Label values are bounded: request classes come from a fixed enum, tenants from the keys
file, partitions from the executor's quota table, tiers from ``TIERS``.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily

from services.mesh import metrics

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
TIERS = ("active", "sleeping", "archived")  # executor GPU/CPU pool, cachestore host RAM, cachestore disk
KV_STATES = ("used", "reserved", "borrowed")
# Priority is in "class levels" (services/scheduler/policy/priority.py): interactive 0,
# agentic -1, batch -3, moved by the caller's field, program service, slack and aging.
PRIORITY_BUCKETS = (-4.0, -3.0, -2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 4.0)
RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.25, 1.5, 2.0, 4.0, 10.0)
INTENT_DECISIONS = ("shifted", "kept", "unavailable")


@dataclass(frozen=True)
class MetricSpec:
    """One catalogue entry. ``service`` is the process that exports it; ``waits_for``
    names the issue whose feature makes it move (None: live now)."""

    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    labels: tuple[str, ...]
    help: str
    service: str
    waits_for: str | None = None
    buckets: tuple[float, ...] | None = None

    @property
    def live(self) -> bool:
        return self.waits_for is None



CATALOGUE: tuple[MetricSpec, ...] = (
    # -- latency, by request class and tenant (router: where a request starts and ends)
    MetricSpec("weft_ttft_seconds", "histogram", ("request_class", "tenant"),
               "Time from the request reaching the router to its first token.", "router",
               buckets=LATENCY_BUCKETS_S),
    MetricSpec("weft_tpot_seconds", "histogram", ("request_class", "tenant"),
               "Mean time per output token after the first, one observation per request.", "router",
               buckets=TOKEN_LATENCY_BUCKETS_S),
    MetricSpec("weft_e2e_seconds", "histogram", ("request_class", "tenant"),
               "Time from the request reaching the router to its last token.", "router",
               buckets=LATENCY_BUCKETS_S),
    # -- queueing and admission (scheduler)
    MetricSpec("weft_queue_depth", "gauge", ("service",),
               "Requests waiting for an in-flight slot (service: scheduler).", "scheduler"),
    MetricSpec("weft_queue_wait_seconds", "histogram", ("request_class",),
               "Time a request waited for admission in the scheduler.", "scheduler",
               buckets=LATENCY_BUCKETS_S),
    MetricSpec("weft_admission_rejections_total", "counter", ("reason",),
               "Requests refused at admission (reason: shed, queue_full, no_executor).", "scheduler"),
    # -- KV memory per partition (executor)
    MetricSpec("weft_kv_blocks", "gauge", ("executor", "partition", "state"),
               "KV blocks per partition: used, reserved (its guaranteed share), borrowed (used beyond it).",
               "executor"),
    MetricSpec("weft_kv_pool_blocks", "gauge", ("executor", "state"),
               "KV pool size and free blocks (state: total, free).", "executor"),
    MetricSpec("weft_kv_preemptions_total", "counter", ("executor",),
               "Running requests preempted because the KV pool (or a partition quota) ran out.", "executor"),
    MetricSpec("weft_executor_queue_depth", "gauge", ("executor",),
               "Requests an executor holds but has not scheduled yet (waiting for KV or a slot).", "executor"),
    # -- engine steps (executor): where its time goes, and what bounds it
    MetricSpec("weft_executor_step_seconds", "histogram", ("executor", "kind"),
               "Wall time of one engine step's forward and sampling (kind: decode = decode rows only, "
               "prefill = prefill chunks only, mixed = both).", "executor", buckets=TOKEN_LATENCY_BUCKETS_S),
    MetricSpec("weft_executor_step_tokens_total", "counter", ("executor", "kind"),
               "Tokens engine steps computed (kind: decode = one per decode row, prefill = prompt chunk tokens).",
               "executor"),
    # -- tiers: hit rates, demotion and promotion
    MetricSpec("weft_kv_lookup_tokens_total", "counter", ("tier", "result"),
               "Prompt tokens looked up in a KV tier, by result (hit, miss); active = executor prefix cache.",
               "executor"),
    MetricSpec("weft_cachestore_tier_lookups_total", "counter", ("tier", "result"),
               "Block lookups in a cachestore tier (sleeping = host RAM, archived = disk) by result.", "cachestore"),
    MetricSpec("weft_kv_demotions_total", "counter", ("from_tier", "to_tier"),
               "KV blocks moved down a tier (executor to cachestore, host RAM to disk).", "cachestore"),
    MetricSpec("weft_kv_promotions_total", "counter", ("from_tier", "to_tier"),
               "KV blocks moved up a tier (disk to host RAM, cachestore back to an executor).", "cachestore"),
    # -- agent-native features
    MetricSpec("weft_session_pauses_total", "counter", ("action",),
               "Tool-call pauses by what happened to the session's KV (keep, demote, drop).", "scheduler"),
    MetricSpec("weft_migrations_total", "counter", ("reason",),
               "Requests continued on another executor mid-stream (counted per move).", "scheduler"),
    MetricSpec("weft_scheduler_priority", "histogram", ("request_class",),
               "Priority a request was placed with (higher ran first; in class levels).", "scheduler",
               buckets=PRIORITY_BUCKETS),
    MetricSpec("weft_scheduler_intent_shift_total", "counter", ("decision",),
               "Intent-shift checks of session hops by decision (shifted, kept, unavailable).", "scheduler"),
    MetricSpec("weft_scheduler_fallbacks_total", "counter", ("path",),
               "Contract fallbacks taken because a ceiling could not be met (degrade, reroute, fail_fast).",
               "scheduler"),
    MetricSpec("weft_scheduler_ttft_ceiling_total", "counter", ("request_class", "outcome"),
               "Requests with a contract TTFT ceiling by whether the TTFT the scheduler observed met it.",
               "scheduler"),
    MetricSpec("weft_scheduler_ttft_ceiling_ratio", "histogram", ("request_class",),
               "Observed TTFT divided by the contract's TTFT ceiling (above 1: missed).", "scheduler",
               buckets=RATIO_BUCKETS),
    MetricSpec("weft_degradation_rung", "gauge", ("request_class",),
               "Current rung of the degradation ladder per class (0 = full quality, 4 = shed).", "scheduler"),
    # -- the verdict (router: it sees whole timelines)
    MetricSpec("weft_p99_attribution_seconds", "gauge", ("component",),
               "Mean time per component among the slowest 1 % of recent requests.", "router"),
    MetricSpec("weft_p99_verdict", "gauge", ("cause",),
               "1 for the component that dominates recent tail latency, 0 for the others.", "router"),
    MetricSpec("weft_p99_latency_seconds", "gauge", ("quantile",),
               "Rolling end-to-end latency quantiles (0.5, 0.99) over the attribution window.", "router"),
)

_BY_NAME = {spec.name: spec for spec in CATALOGUE}
# Exported by ``TierStatsCollector`` at scrape time from the tiers' own hit/miss counters.
COLLECTED = frozenset({"weft_cachestore_tier_lookups_total"})


def spec(name: str) -> MetricSpec:
    return _BY_NAME[name]


def for_service(service: str) -> list[MetricSpec]:
    return [s for s in CATALOGUE if s.service == service]


def metric(name: str):
    """The Prometheus object of a catalogue entry (get-or-create in the process registry)."""
    s = _BY_NAME[name]
    if name in COLLECTED:
        raise ValueError(f"{name} is exported by TierStatsCollector, not recorded directly")
    if s.kind == "counter":
        return metrics.counter(s.name, s.help, s.labels)
    if s.kind == "gauge":
        return metrics.gauge(s.name, s.help, s.labels)
    return metrics.histogram(s.name, s.help, s.labels, s.buckets)


def register(service: str) -> None:
    """Declare every metric ``service`` exports, so a scrape lists them before any event."""
    for s in for_service(service):
        if s.name not in COLLECTED:
            metric(s.name)


# -- recording: one function per event ------------------------------------------------
def request_class_label(request_class: str) -> str:
    return request_class or "unspecified"


def observe_request(request_class: str, tenant: str, ttft_s: float | None, e2e_s: float,
                    num_output_tokens: int) -> None:
    """A request finished at the router. TPOT is (e2e - ttft) / (tokens - 1)."""
    labels = (request_class_label(request_class), tenant or "default")
    if ttft_s is not None:
        metric("weft_ttft_seconds").labels(*labels).observe(ttft_s)
        if num_output_tokens > 1:
            metric("weft_tpot_seconds").labels(*labels).observe(max(0.0, e2e_s - ttft_s) / (num_output_tokens - 1))
    metric("weft_e2e_seconds").labels(*labels).observe(e2e_s)


def set_queue_depth(service: str, depth: int) -> None:
    metric("weft_queue_depth").labels(service).set(depth)


def observe_queue_wait(request_class: str, wait_s: float) -> None:
    metric("weft_queue_wait_seconds").labels(request_class_label(request_class)).observe(wait_s)


def count_admission_rejection(reason: str) -> None:
    metric("weft_admission_rejections_total").labels(reason).inc()


_kv_partitions: dict[str, set[str]] = {}  # executor -> partitions its last set_kv_usage exported


def set_kv_usage(executor: str, partitions: Iterable, num_blocks: int, num_free_blocks: int) -> None:
    """``partitions``: objects with name / used_blocks / reserved_blocks / borrowed_blocks
    (``BlockPool.usage()``), the pool's whole truth at this moment.

    A partition exported before but absent now (a tenant's last request ended: the pool
    lists only partitions with a quota or in use; or its quota was removed) is set to 0:
    a gauge keeps its last value until set, so without this ``weft top`` showed a
    tenant's blocks as used long after the pool was empty (issue 12). Its label set stays,
    at 0, so a scrape sees the drop; names are bounded (tenants from the keys file)."""
    kv = metric("weft_kv_blocks")
    seen = set()
    for p in partitions:
        seen.add(p.name)
        kv.labels(executor, p.name, "used").set(p.used_blocks)
        kv.labels(executor, p.name, "reserved").set(p.reserved_blocks)
        kv.labels(executor, p.name, "borrowed").set(p.borrowed_blocks)
    for name in _kv_partitions.get(executor, set()) - seen:
        for state in KV_STATES:
            kv.labels(executor, name, state).set(0)
    _kv_partitions[executor] = _kv_partitions.get(executor, set()) | seen
    pool = metric("weft_kv_pool_blocks")
    pool.labels(executor, "total").set(num_blocks)
    pool.labels(executor, "free").set(num_free_blocks)


def set_executor_queue_depth(executor: str, depth: int) -> None:
    metric("weft_executor_queue_depth").labels(executor).set(depth)


def count_preemptions(executor: str, num: int) -> None:
    if num:
        metric("weft_kv_preemptions_total").labels(executor).inc(num)


STEP_KINDS = ("decode", "prefill", "mixed")


def observe_step(executor: str, num_decode_tokens: int, num_prefill_tokens: int, seconds: float) -> None:
    """One engine step that computed ``num_decode_tokens`` decode rows and
    ``num_prefill_tokens`` prompt tokens in ``seconds``."""
    kind = "mixed" if num_decode_tokens and num_prefill_tokens else "decode" if num_decode_tokens else "prefill"
    metric("weft_executor_step_seconds").labels(executor, kind).observe(seconds)
    tokens = metric("weft_executor_step_tokens_total")
    if num_decode_tokens:
        tokens.labels(executor, "decode").inc(num_decode_tokens)
    if num_prefill_tokens:
        tokens.labels(executor, "prefill").inc(num_prefill_tokens)


def count_prefix_lookup(num_prompt_tokens: int, num_cached_tokens: int) -> None:
    """The executor's prefix cache (tier ``active``) served ``num_cached_tokens`` of a prompt."""
    lookups = metric("weft_kv_lookup_tokens_total")
    lookups.labels("active", "hit").inc(num_cached_tokens)
    lookups.labels("active", "miss").inc(max(0, num_prompt_tokens - num_cached_tokens))


def count_demotion(from_tier: str, to_tier: str, num_blocks: int = 1) -> None:
    metric("weft_kv_demotions_total").labels(from_tier, to_tier).inc(num_blocks)


def count_promotion(from_tier: str, to_tier: str, num_blocks: int = 1) -> None:
    metric("weft_kv_promotions_total").labels(from_tier, to_tier).inc(num_blocks)


def count_pause(action: str) -> None:
    metric("weft_session_pauses_total").labels(action).inc()


def count_migration(reason: str, num: int = 1) -> None:
    metric("weft_migrations_total").labels(reason).inc(num)


def observe_priority(request_class: str, priority: float) -> None:
    metric("weft_scheduler_priority").labels(request_class_label(request_class)).observe(priority)


def count_intent_shift(decision: str) -> None:
    if decision not in INTENT_DECISIONS:
        raise ValueError(f"intent-shift decision {decision!r} is not one of {INTENT_DECISIONS}")
    metric("weft_scheduler_intent_shift_total").labels(decision).inc()


def count_fallback(path: str) -> None:
    metric("weft_scheduler_fallbacks_total").labels(path).inc()


def observe_ttft_ceiling(request_class: str, met: bool, ratio: float) -> None:
    """A request with a TTFT ceiling got its first token: ``ratio`` = observed / ceiling."""
    label = request_class_label(request_class)
    metric("weft_scheduler_ttft_ceiling_total").labels(label, "met" if met else "missed").inc()
    metric("weft_scheduler_ttft_ceiling_ratio").labels(label).observe(ratio)


def set_degradation_rung(request_class: str, rung: int) -> None:
    metric("weft_degradation_rung").labels(request_class_label(request_class)).set(rung)


class TierStatsCollector:
    """Exports the cachestore's per-tier hit / miss counts at scrape time from the tiers'
    own counters, so the tier code needs no metric calls of its own."""

    def __init__(self, store=None) -> None:
        self.store = store

    def collect(self):
        s = spec("weft_cachestore_tier_lookups_total")
        lookups = CounterMetricFamily(s.name.removesuffix("_total"), s.help, labels=s.labels)
        for tier, t in (("sleeping", getattr(self.store, "host", None)), ("archived", getattr(self.store, "disk", None))):
            if t is not None:
                lookups.add_metric([tier, "hit"], float(getattr(t, "num_hits", 0)))
                lookups.add_metric([tier, "miss"], float(getattr(t, "num_misses", 0)))
        yield lookups


_watched: list[TierStatsCollector] = []


def watch_cachestore(store=None) -> TierStatsCollector:
    """Export ``store``'s tier metrics (one collector per process; a later store
    replaces the earlier one, as tests build several)."""
    if not _watched:
        collector = TierStatsCollector()
        metrics.REGISTRY.register(collector)
        _watched.append(collector)
    _watched[0].store = store
    return _watched[0]
