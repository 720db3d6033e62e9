"""Per-request timelines as OpenTelemetry-style spans carried through the mesh.

NOTE: how a timeline crosses the mesh, with no extra RPC and no proto change:

    router ──Generate + metadata traceparent──▶ scheduler ──traceparent──▶ executor
    router ◀──trailers weft-spans (sched+exec)── scheduler ◀──trailers weft-spans── executor

Each service records its own spans (W3C trace id shared by all, its own span ids,
parent = the caller's span) and returns them, plus those it got from downstream, in
the ``weft-spans`` trailing metadata of the stream. The router therefore holds the
whole timeline once the stream ends and keeps the last ``capacity`` of them, by
request id, in ``TimelineStore`` (served at ``/v1/weft/requests/{id}/timeline``). A
stream that fails or is cancelled sends no trailers: its timeline has the router's
spans only (the other services keep none: nothing could read them there).

Decisions: the scheduler records each decision it makes for a request (admission and
priority, contract fallback, rung, intent shift, the TTFT contract, the pause) as one
event named ``scheduler.decision.<kind>`` with the decision in its attributes
(``Trace.decision``); ``timeline_json`` also lists them by kind under ``decisions``.

Clocks: span times are Unix epoch nanoseconds (``time.time_ns``) so spans from several
processes on one host order correctly; across hosts they are as good as NTP.
"""
from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections import OrderedDict
from contextvars import ContextVar
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import grpc

TRACEPARENT_KEY = "traceparent"
SPANS_KEY = "weft-spans"
MAX_SPANS_PER_SERVICE = 48  # bounds the trailer (gRPC's default metadata limit is 8 KiB)
DECISION_PREFIX = "scheduler.decision."  # events of scheduling decisions (Trace.decision)


@dataclass(frozen=True)
class Span:
    """One timed step of one request in one service. Zero-length spans are events
    (``first_token``, ``preempted``)."""

    trace_id: str
    span_id: str
    parent_id: str
    name: str
    service: str
    start_ns: int
    end_ns: int
    attrs: dict = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    def to_json(self) -> dict:
        return {"trace_id": self.trace_id, "span_id": self.span_id, "parent_id": self.parent_id,
                "name": self.name, "service": self.service, "start_ns": self.start_ns,
                "end_ns": self.end_ns, "attrs": dict(self.attrs)}

    @staticmethod
    def from_json(d: dict) -> Span:
        return Span(str(d["trace_id"]), str(d["span_id"]), str(d.get("parent_id", "")), str(d["name"]),
                    str(d["service"]), int(d["start_ns"]), int(d["end_ns"]), dict(d.get("attrs") or {}))


def new_id(num_bytes: int) -> str:
    return os.urandom(num_bytes).hex()


@dataclass(frozen=True)
class TraceContext:
    """W3C trace context: the trace and the caller's span."""

    trace_id: str
    parent_span_id: str

    def traceparent(self) -> str:
        return f"00-{self.trace_id}-{self.parent_span_id}-01"

    @staticmethod
    def parse(value: str | None) -> TraceContext | None:
        """A ``traceparent`` header value, or None when absent or malformed."""
        parts = (value or "").split("-")
        if len(parts) != 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
            return None
        try:
            int(parts[1], 16), int(parts[2], 16)
        except ValueError:
            return None
        return TraceContext(parts[1], parts[2])


def context_from_metadata(metadata: Iterable[tuple[str, str]] | None) -> TraceContext | None:
    for key, value in metadata or ():
        if key == TRACEPARENT_KEY:
            return TraceContext.parse(value if isinstance(value, str) else value.decode())
    return None


def spans_from_metadata(metadata: Iterable[tuple[str, str]] | None) -> list[Span]:
    """Spans a downstream service returned in its trailers (malformed ones are dropped)."""
    for key, value in metadata or ():
        if key == SPANS_KEY:
            try:
                return [Span.from_json(d) for d in json.loads(value)]
            except (ValueError, KeyError, TypeError):
                return []
    return []


async def downstream_spans(call, timeout_s: float = 1.0) -> list[Span]:
    """The spans in a finished call's trailers. Call it right after the stream's last
    message (the trailers follow at once); an error or a slow peer yields none. Waits in
    the caller's task (``asyncio.timeout``: ``wait_for`` started a task per call)."""
    try:
        async with asyncio.timeout(timeout_s):
            metadata = await call.trailing_metadata()
    except (TimeoutError, grpc.RpcError):
        return []
    return spans_from_metadata(metadata)


def spans_metadata(spans: Sequence[Span]) -> tuple[tuple[str, str], ...]:
    body = json.dumps([s.to_json() for s in spans], separators=(",", ":"))
    return ((SPANS_KEY, body),)


class Trace:
    """One service's spans for one request. The root span covers the service's whole
    handling; ``span``/``event`` add children. Not thread-safe: one request, one task."""

    def __init__(self, request_id: str, service: str, parent: TraceContext | None = None,
                 start_ns: int | None = None, **attrs) -> None:
        self.request_id = request_id
        self.service = service
        self.trace_id = parent.trace_id if parent else new_id(16)
        self.parent_id = parent.parent_span_id if parent else ""
        self.root_id = new_id(8)
        self.start_ns = time.time_ns() if start_ns is None else start_ns
        self.attrs = dict(attrs)
        self.spans: list[Span] = []
        self.downstream: list[Span] = []
        self.root: Span | None = None

    def context(self) -> TraceContext:
        """The context to send downstream (their parent is this service's root span)."""
        return TraceContext(self.trace_id, self.root_id)

    def span(self, name: str, start_ns: int, end_ns: int | None = None, **attrs) -> Span:
        """Record a finished child span (``end_ns`` None: an event at ``start_ns``)."""
        s = Span(self.trace_id, new_id(8), self.root_id, name, self.service, start_ns,
                 start_ns if end_ns is None else end_ns, attrs)
        if len(self.spans) < MAX_SPANS_PER_SERVICE - 1:
            self.spans.append(s)
        return s

    def event(self, name: str, **attrs) -> Span:
        return self.span(name, time.time_ns(), **attrs)

    def decision(self, kind: str, **attrs) -> Span:
        """An event recording one decision made for the request (``kind``: admission,
        fallback, rung, intent_shift, ttft, pause) with what was decided."""
        return self.event(DECISION_PREFIX + kind, **attrs)

    def add_downstream(self, spans: Sequence[Span]) -> None:
        self.downstream.extend(spans)

    def finish(self, store: TimelineStore | None = None, **attrs) -> list[Span]:
        """Close the root span; returns this service's spans plus downstream ones (and
        keeps them in ``store``). Idempotent: a second call returns the same spans."""
        if self.root is None:
            self.attrs.update(attrs)
            self.root = Span(self.trace_id, self.root_id, self.parent_id, f"{self.service}.request",
                             self.service, self.start_ns, time.time_ns(), {"request_id": self.request_id, **self.attrs})
            if store is not None:
                store.add(self.request_id, self.all_spans())
        return self.all_spans()

    def all_spans(self) -> list[Span]:
        own = ([self.root] if self.root else []) + self.spans
        return own + self.downstream


class TimelineStore:
    """The last ``capacity`` requests' spans, by request id (thread-safe)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._spans: OrderedDict[str, list[Span]] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, request_id: str, spans: Sequence[Span]) -> None:
        with self._lock:
            have = self._spans.pop(request_id, [])
            known = {s.span_id for s in have}
            self._spans[request_id] = have + [s for s in spans if s.span_id not in known]
            while len(self._spans) > self.capacity:
                self._spans.popitem(last=False)

    def get(self, request_id: str) -> list[Span] | None:
        """The request's spans ordered by start (parents before children at ties)."""
        with self._lock:
            spans = self._spans.get(request_id)
        if spans is None:
            return None
        return sorted(spans, key=lambda s: (s.start_ns, s.name.endswith(".request") is False, -s.end_ns))

    def __len__(self) -> int:
        return len(self._spans)


STORE = TimelineStore(capacity=1024)  # the router's timelines (~10 KB each)
# The trace of the request the current task works for: how an outbound client finds the
# context to send without every call signature in between carrying it.
CURRENT_TRACE: ContextVar[Trace | None] = ContextVar("weft_current_trace", default=None)


def timeline_json(request_id: str, spans: Sequence[Span]) -> dict:
    """The document served for a request: spans with offsets from the first start, and
    the scheduling decisions' attributes by kind (the last, after a continuation)."""
    t0 = min((s.start_ns for s in spans), default=0)
    return {
        "request_id": request_id,
        "trace_id": spans[0].trace_id if spans else "",
        "services": sorted({s.service for s in spans}),
        "decisions": {s.name.removeprefix(DECISION_PREFIX): dict(s.attrs) for s in spans
                      if s.name.startswith(DECISION_PREFIX)},
        "spans": [{**s.to_json(), "offset_ms": round((s.start_ns - t0) / 1e6, 3),
                   "duration_ms": round((s.end_ns - s.start_ns) / 1e6, 3)} for s in spans],
    }
