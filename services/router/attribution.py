"""p99 attribution: why the slowest recent requests were slow.

NOTE: the method. Every finished request's timeline (router + scheduler + executor
spans) is split into components that add up to its end-to-end latency:

    queueing       scheduler admission wait + executor wait that was not KV-blocked
    kv_contention  executor wait while the pool could not hold the next chunk
                   + time spent preempted (blocks taken back, waiting to recompute)
    prefill        first scheduled → first token, minus preempted time (long prompts)
    decode         first token → last token, minus preempted time (long outputs)
    tier_miss      looking up / fetching the prompt's prefix in the cachestore before
                   prefill (spans ``*.tier_fetch``)
    migration      continuing on another executor (spans ``*.migration``)
    degraded       time served on a degraded rung (spans ``*.degraded``)
    overhead       the rest: tokenize, placement, hops

Over a rolling window (the last ``window`` requests, at most ``max_age_s`` old), the
tail is the slowest 1 % (at least one request) and the baseline is the requests at or
under the median. The verdict names the component whose mean grows most from the
baseline to the tail: that is what the tail pays for and the median does not. A
component shared equally by every request (a fixed decode length) cannot be named.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from services.mesh import metric_catalogue as catalogue
from services.mesh.timeline import Span

COMPONENTS = ("queueing", "kv_contention", "prefill", "decode", "tier_miss", "migration", "degraded", "overhead")
CAUSES = {  # what the verdict says for each component
    "queueing": "requests wait for admission: the mesh is over capacity",
    "kv_contention": "requests wait for KV blocks or are preempted: the pool (or a partition) is full",
    "prefill": "long prompts: prefill dominates the tail",
    "decode": "long generations: the tail asks for more tokens",
    "tier_miss": "prefix KV was looked up in / fetched from the cachestore before prefill",
    "migration": "requests moved to another executor mid-stream",
    "degraded": "requests ran on a degraded rung",
    "overhead": "time outside queueing and compute (tokenize, placement, hops)",
}


@dataclass(frozen=True)
class Breakdown:
    """One request's latency split into ``COMPONENTS`` (seconds)."""

    request_id: str
    e2e_s: float
    parts: dict[str, float]
    finished_at_s: float
    tenant: str = ""  # whose request: a tenant's verdict covers its own requests only


def _overlap_ns(a0: int, a1: int, spans: Sequence[Span]) -> int:
    return sum(max(0, min(a1, s.end_ns) - max(a0, s.start_ns)) for s in spans)


def breakdown(request_id: str, spans: Sequence[Span], now_s: float | None = None, tenant: str = "") -> Breakdown | None:
    """Split a timeline; None when it lacks the router's root or the scheduler's spans."""
    by_name: dict[str, list[Span]] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    root = next((s for s in by_name.get("router.request", ())), None)
    if root is None or "scheduler.queue" not in by_name:
        return None  # the downstream part is missing (a stream cut short has no trailers)
    e2e_ns = max(0, root.end_ns - root.start_ns)
    parts = dict.fromkeys(COMPONENTS, 0.0)
    preempted = by_name.get("executor.preempted", [])
    for s in by_name.get("scheduler.queue", ()):
        parts["queueing"] += s.end_ns - s.start_ns
    for s in by_name.get("executor.wait", ()):
        wait = s.end_ns - s.start_ns
        kv, queued = float(s.attrs.get("kv_blocked_ms", 0)), float(s.attrs.get("queued_ms", 0))
        kv_share = kv / (kv + queued) if kv + queued > 0 else 0.0
        parts["kv_contention"] += wait * kv_share
        parts["queueing"] += wait * (1 - kv_share)
    parts["kv_contention"] += sum(s.end_ns - s.start_ns for s in preempted)
    for name, part in (("executor.prefill", "prefill"), ("executor.decode", "decode")):
        for s in by_name.get(name, ()):
            parts[part] += max(0, (s.end_ns - s.start_ns) - _overlap_ns(s.start_ns, s.end_ns, preempted))
    for s in spans:
        for suffix, part in ((".tier_fetch", "tier_miss"), (".migration", "migration"), (".degraded", "degraded")):
            if s.name.endswith(suffix):
                parts[part] += s.end_ns - s.start_ns
    accounted = sum(parts.values())
    parts["overhead"] = max(0.0, e2e_ns - accounted)
    return Breakdown(request_id, e2e_ns / 1e9, {k: v / 1e9 for k, v in parts.items()},
                     time.time() if now_s is None else now_s, tenant)


@dataclass(frozen=True)
class Verdict:
    cause: str | None  # None: no finished request in the window
    explanation: str
    num_requests: int
    num_tail: int
    p50_s: float
    p99_s: float
    tail_s: dict[str, float]  # mean per component among the tail
    baseline_s: dict[str, float]  # mean per component among requests at or under the median

    def to_json(self) -> dict:
        ms = lambda d: {k: round(v * 1000, 3) for k, v in d.items()}  # noqa: E731
        return {"cause": self.cause, "explanation": self.explanation, "num_requests": self.num_requests,
                "num_tail": self.num_tail, "p50_ms": round(self.p50_s * 1000, 3),
                "p99_ms": round(self.p99_s * 1000, 3), "tail_ms": ms(self.tail_s), "baseline_ms": ms(self.baseline_s)}


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))]


def _mean(items: Sequence[Breakdown]) -> dict[str, float]:
    return {c: sum(b.parts[c] for b in items) / len(items) if items else 0.0 for c in COMPONENTS}


def verdict_of(items: Sequence[Breakdown]) -> Verdict:
    """The verdict over ``items`` (pure: no clock, no metrics)."""
    if not items:
        return Verdict(None, "no finished requests in the window", 0, 0, 0.0, 0.0,
                       dict.fromkeys(COMPONENTS, 0.0), dict.fromkeys(COMPONENTS, 0.0))
    ordered = sorted(items, key=lambda b: b.e2e_s)
    e2e = [b.e2e_s for b in ordered]
    p50, p99 = _quantile(e2e, 0.5), _quantile(e2e, 0.99)
    num_tail = max(1, math.ceil(0.01 * len(ordered)))
    tail = ordered[-num_tail:]
    baseline = [b for b in ordered if b.e2e_s <= p50] or ordered[:1]
    tail_mean, base_mean = _mean(tail), _mean(baseline)
    growth = {c: tail_mean[c] - base_mean[c] for c in COMPONENTS}
    if len(ordered) == 1 or max(growth.values()) <= 0:
        cause = max(COMPONENTS, key=lambda c: tail_mean[c])
    else:
        cause = max(COMPONENTS, key=lambda c: (growth[c], tail_mean[c]))
    return Verdict(cause, CAUSES[cause], len(ordered), num_tail, p50, p99, tail_mean, base_mean)


class Attribution:
    """The rolling window and its verdict (thread-safe; metrics refreshed at most every
    ``refresh_s`` on the observe path, and on every ``verdict()`` call)."""

    def __init__(self, window: int = 2000, max_age_s: float = 300.0, refresh_s: float = 1.0) -> None:
        self.max_age_s = max_age_s
        self.refresh_s = refresh_s
        self._items: deque[Breakdown] = deque(maxlen=window)
        self._lock = threading.Lock()
        self._last_refresh_s = 0.0

    def observe(self, request_id: str, spans: Sequence[Span], tenant: str = "") -> Breakdown | None:
        b = breakdown(request_id, spans, tenant=tenant)
        if b is None:
            return None
        with self._lock:
            self._items.append(b)
        if time.monotonic() - self._last_refresh_s >= self.refresh_s:
            self.verdict()
        return b

    def verdict(self, now_s: float | None = None, max_age_s: float | None = None,
                tenant: str | None = None) -> Verdict:
        """The verdict over the window, or over its last ``max_age_s`` seconds; with
        ``tenant``, over that tenant's requests only (what the public API serves: one
        tenant must not learn another's latencies). Only the all-tenant verdict is
        exported to the metrics (the operator's view, on the metrics port)."""
        now_s = time.time() if now_s is None else now_s
        with self._lock:
            while self._items and now_s - self._items[0].finished_at_s > self.max_age_s:
                self._items.popleft()
            items = list(self._items)
        if max_age_s is not None:
            items = [b for b in items if now_s - b.finished_at_s <= max_age_s]
        if tenant is not None:
            return verdict_of([b for b in items if b.tenant == tenant])
        v = verdict_of(items)
        self._last_refresh_s = time.monotonic()
        self._export(v)
        return v

    @staticmethod
    def _export(v: Verdict) -> None:
        parts = catalogue.metric("weft_p99_attribution_seconds")
        causes = catalogue.metric("weft_p99_verdict")
        for c in COMPONENTS:
            parts.labels(c).set(v.tail_s[c])
            causes.labels(c).set(1 if c == v.cause else 0)
        latency = catalogue.metric("weft_p99_latency_seconds")
        latency.labels("0.5").set(v.p50_s)
        latency.labels("0.99").set(v.p99_s)


ATTRIBUTION = Attribution()  # this router's window
