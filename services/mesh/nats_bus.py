"""Events over NATS: protobuf payloads on ``weft.<kind>.<source>``.

Every event carries an ``EventHeader`` (id, source, sequence, timestamp, epoch). The
sequence counts per stream, a stream being one (kind, source) pair, i.e. one subject,
and it advances on every publish *attempt* — so an event dropped while NATS is down
shows up at consumers as a gap, and they resync.

NATS is for hints, never for correctness: ``publish`` never raises into the caller.
While disconnected, events are dropped and counted (no replay of stale news); the bus
reconnects forever in the background, including when NATS is down at start.

NOTE (ordering): NATS core delivers one publisher's messages to one subscriber in
order, so per stream a sequence <= the last one seen is a duplicate, one more is in
order, anything larger is a gap; a new ``epoch`` means the source restarted.
"""
from __future__ import annotations

import asyncio
import enum
import inspect
import os
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog
from google.protobuf.message import DecodeError, Message
from nats.aio.client import Client as NatsClient

from services.mesh import metrics

log = structlog.get_logger(__name__)

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]+$")

EVENTS_PUBLISHED = metrics.counter("weft_bus_events_published_total", "Events sent to NATS.", ["kind"])
EVENTS_DROPPED = metrics.counter("weft_bus_events_dropped_total", "Events dropped: NATS unreachable.", ["kind"])
EVENTS_RECEIVED = metrics.counter("weft_bus_events_received_total", "Events delivered to handlers.", ["kind"])
EVENTS_DUPLICATE = metrics.counter("weft_bus_events_duplicate_total", "Duplicate events ignored.", ["kind"])
EVENT_GAPS = metrics.counter("weft_bus_event_gaps_total", "Sequence gaps detected.", ["kind"])


def subject(kind: str, source: str) -> str:
    """``weft.<kind>.<source>``; both parts must be subject-safe names."""
    for part, value in (("kind", kind), ("source", source)):
        if not _NAME_RE.match(value):
            raise ValueError(f"{part} {value!r} must match {_NAME_RE.pattern}")
    return f"weft.{kind}.{source}"


# -- ordering -------------------------------------------------------------------------
class Delivery(enum.Enum):
    """How an event relates to what was seen before on its stream."""

    FIRST = "first"  # first event of this stream (earlier ones, if any, were never seen)
    IN_ORDER = "in_order"
    GAP = "gap"  # newer than expected: events were lost
    RESTARTED = "restarted"  # the source restarted (new epoch); its old state is void
    DUPLICATE = "duplicate"  # already seen: not delivered to handlers

    @property
    def needs_resync(self) -> bool:
        """Whether the consumer's state for this source may be stale."""
        return self in (Delivery.GAP, Delivery.RESTARTED)


class SequenceTracker:
    """Dedupe and gap detection per stream. Pure bookkeeping, no I/O."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[str, int]] = {}  # stream -> (epoch, last sequence)

    def observe(self, stream: str, epoch: str, sequence: int) -> Delivery:
        """Classify an event and record it (duplicates are not recorded)."""
        prev = self._last.get(stream)
        if prev is None:
            self._last[stream] = (epoch, sequence)
            return Delivery.FIRST
        prev_epoch, last = prev
        if epoch != prev_epoch:
            self._last[stream] = (epoch, sequence)
            return Delivery.RESTARTED
        if sequence <= last:
            return Delivery.DUPLICATE
        self._last[stream] = (epoch, sequence)
        return Delivery.IN_ORDER if sequence == last + 1 else Delivery.GAP

    def forget(self, stream: str) -> None:
        self._last.pop(stream, None)


Handler = Callable[[Message, Delivery], Awaitable[None] | None]


@dataclass
class _Subscription:
    kind: str
    source: str  # "*" for every source
    message_cls: type[Message]
    handler: Handler


class EventBus:
    """Publisher and subscriber for one process (``source`` names it on the bus)."""

    def __init__(self, url: str, source: str, reconnect_wait_s: float = 0.5) -> None:
        subject("x", source)  # validates the name
        self.url = url
        self.source = source
        self.epoch = uuid.uuid4().hex
        self.reconnect_wait_s = reconnect_wait_s
        self._nc: NatsClient | None = None
        self._sequences: dict[str, int] = {}
        self._tracker = SequenceTracker()
        self._subs: list[_Subscription] = []
        self._on_connect: list[Callable[[], Awaitable[None] | None]] = []
        self._connect_task: asyncio.Task | None = None
        self._connected = asyncio.Event()
        self._closed = False
        self._warned_unreachable = False
        self.num_published = 0
        self.num_dropped = 0

    # -- lifecycle ------------------------------------------------------------------
    async def start(self) -> None:
        """Begin connecting in the background; returns at once (NATS may be down)."""
        if self._connect_task is None:
            self._connect_task = asyncio.create_task(self._connect_forever(), name="weft-nats-connect")

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    async def wait_connected(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._connected.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return self.connected

    def on_connect(self, callback: Callable[[], Awaitable[None] | None]) -> None:
        """Call ``callback`` after the first connect and after every reconnect."""
        self._on_connect.append(callback)

    async def close(self) -> None:
        self._closed = True
        if self._connect_task is not None:
            self._connect_task.cancel()
            try:
                await self._connect_task
            except (asyncio.CancelledError, Exception):
                pass
        if self._nc is not None:
            try:
                await asyncio.wait_for(self._nc.close(), 2.0)
            except Exception:
                pass
            self._nc = None

    async def _connect_forever(self) -> None:
        attempt = 0
        while not self._closed:
            nc = NatsClient()
            try:
                await nc.connect(
                    servers=[self.url], name=self.source, connect_timeout=1,
                    allow_reconnect=True, max_reconnect_attempts=-1,
                    reconnect_time_wait=self.reconnect_wait_s,
                    error_cb=self._on_error, disconnected_cb=self._on_disconnected,
                    reconnected_cb=self._on_reconnected,
                )
            except Exception as exc:
                if attempt == 0:
                    log.warning("nats_unreachable", url=self.url, error=str(exc))
                attempt += 1
                await asyncio.sleep(min(self.reconnect_wait_s * (1 + attempt / 4), 2.0))
                continue
            self._nc = nc
            self._warned_unreachable = False
            for sub in self._subs:
                await self._subscribe_on(nc, sub)
            log.info("nats_connected", url=self.url, source=self.source)
            self._connected.set()
            await self._fire_on_connect()
            return

    async def _on_error(self, exc: Exception) -> None:
        # nats-py retries connecting internally and reports each failure here: warn
        # once per outage, the rest at debug.
        if not self.connected and not self._warned_unreachable:
            self._warned_unreachable = True
            log.warning("nats_unreachable", url=self.url, error=str(exc))
        else:
            log.debug("nats_error", error=str(exc))

    async def _on_disconnected(self) -> None:
        self._connected.clear()
        if not self._closed:
            log.warning("nats_disconnected", url=self.url)

    async def _on_reconnected(self) -> None:
        self._connected.set()
        self._warned_unreachable = False
        log.info("nats_reconnected", url=self.url)
        await self._fire_on_connect()

    async def _fire_on_connect(self) -> None:
        for cb in self._on_connect:
            try:
                result = cb()
                if inspect.isawaitable(result):
                    await result
            except Exception:
                log.exception("nats_on_connect_failed")

    # -- publishing -----------------------------------------------------------------
    def next_header(self, kind: str, header) -> None:
        """Fill an ``EventHeader`` in place for the next event of ``kind``."""
        seq = self._sequences.get(kind, 0) + 1
        self._sequences[kind] = seq
        header.event_id = uuid.uuid4().hex
        header.source = self.source
        header.sequence = seq
        header.timestamp_ms = int(time.time() * 1000)
        header.epoch = self.epoch

    async def publish(self, kind: str, message: Message) -> bool:
        """Stamp ``message.header`` and send it. Never raises; False when dropped."""
        self.next_header(kind, message.header)
        nc = self._nc
        if nc is None or not nc.is_connected:
            return self._drop(kind)
        try:
            await nc.publish(subject(kind, self.source), message.SerializeToString())
        except Exception as exc:
            log.debug("event_publish_failed", kind=kind, error=str(exc))
            return self._drop(kind)
        self.num_published += 1
        EVENTS_PUBLISHED.labels(kind).inc()
        return True

    def _drop(self, kind: str) -> bool:
        self.num_dropped += 1
        EVENTS_DROPPED.labels(kind).inc()
        return False

    # -- subscribing ----------------------------------------------------------------
    async def subscribe(self, kind: str, message_cls: type[Message], handler: Handler, source: str = "*") -> None:
        """Deliver events of ``kind`` (from ``source`` or all) to ``handler(msg, delivery)``,
        duplicates removed. Survives reconnects; may be called before NATS is up."""
        sub = _Subscription(kind, source, message_cls, handler)
        self._subs.append(sub)
        if self.connected:
            await self._subscribe_on(self._nc, sub)

    async def _subscribe_on(self, nc: NatsClient, sub: _Subscription) -> None:
        subj = f"weft.{sub.kind}.{sub.source}"

        async def on_message(msg) -> None:
            try:
                event = sub.message_cls.FromString(msg.data)
            except DecodeError:
                log.warning("event_malformed", subject=msg.subject)
                return
            await self.deliver(sub.kind, event, sub.handler)

        await nc.subscribe(subj, cb=on_message)

    async def deliver(self, kind: str, event: Message, handler: Handler) -> Delivery:
        """Classify ``event`` and hand it to ``handler`` unless it is a duplicate."""
        h = event.header
        delivery = self._tracker.observe(f"{kind}.{h.source}", h.epoch, h.sequence)
        if delivery is Delivery.DUPLICATE:
            EVENTS_DUPLICATE.labels(kind).inc()
            return delivery
        if delivery is Delivery.GAP:
            EVENT_GAPS.labels(kind).inc()
            log.info("event_gap", kind=kind, source=h.source, sequence=h.sequence)
        EVENTS_RECEIVED.labels(kind).inc()
        try:
            result = handler(event, delivery)
            if inspect.isawaitable(result):
                await result
        except Exception:
            log.exception("event_handler_failed", kind=kind, source=h.source)
        return delivery


def default_source(prefix: str) -> str:
    """A bus name unique per process: ``<prefix>-<pid>``."""
    return f"{prefix}-{os.getpid()}"
