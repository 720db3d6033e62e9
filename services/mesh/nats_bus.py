"""Events over NATS: protobuf payloads on ``weft.<kind>.<source>``.

Every event carries an ``EventHeader`` (id, source, sequence, timestamp, epoch). The
sequence counts per stream, a stream being one (kind, source) pair, i.e. one subject,
and it advances on every publish *attempt* — so an event dropped while NATS is down
shows up at consumers as a gap, and they resync.

NATS is for hints, never for correctness: ``publish`` never raises into the caller.
While disconnected, events are dropped and counted (no replay of stale news); the bus
reconnects forever in the background, including when NATS is down at start.

Security (nats_auth.py, heartbeat_signing.py): the bus logs in with its role's
credentials (``WEFT_NATS_USER`` / ``WEFT_NATS_PASSWORD``, or ones in the URL; logs print
the URL redacted), trusts the mesh CA when the server requires TLS, applies *sealers*
to a stamped event before sending it (by default: heartbeats are signed when the process
has a mesh secret), and drops a received event whose header names a source other than
its subject's, so a subject permission bounds whom a publisher can speak for.

Ordering (dedupe, gaps, restarts) is event_sequence.py.
"""
from __future__ import annotations

import asyncio
import inspect
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import structlog
from google.protobuf.message import DecodeError, Message
from nats.aio.client import Client as NatsClient
from nats.errors import SlowConsumerError

from services.mesh import metrics, nats_auth
from services.mesh.document_inbox import (MAX_DOCUMENT_BYTES, NATS_PENDING_LIMITS, DocumentHandler, DocumentInbox,
                                          DocumentOrder, DocumentScreen)
from services.mesh.event_sequence import Delivery, SequenceTracker  # noqa: F401  (re-exported)
from services.mesh.subjects import addressed_from, subject

log = structlog.get_logger(__name__)

EVENTS_PUBLISHED = metrics.counter("weft_bus_events_published_total", "Events sent to NATS.", ["kind"])
EVENTS_DROPPED = metrics.counter("weft_bus_events_dropped_total", "Events dropped: NATS unreachable.", ["kind"])
EVENTS_RECEIVED = metrics.counter("weft_bus_events_received_total", "Events delivered to handlers.", ["kind"])
EVENTS_DUPLICATE = metrics.counter("weft_bus_events_duplicate_total", "Duplicate events ignored.", ["kind"])
EVENT_GAPS = metrics.counter("weft_bus_event_gaps_total", "Sequence gaps detected.", ["kind"])
EVENTS_MISADDRESSED = metrics.counter("weft_bus_events_misaddressed_total",
                                      "Events dropped: header source is not the subject's.", ["kind"])

Sealer = Callable[[Message], None]  # completes a stamped event before it is sent (signs it)


Handler = Callable[[Message, Delivery], Awaitable[None] | None]


@dataclass
class _Subscription:
    kind: str
    source: str  # "*" for every source
    message_cls: type[Message]
    handler: Handler
    accept: Callable[[Message], bool] | None = None  # checked before sequence tracking


class EventBus:
    """Publisher and subscriber for one process (``source`` names it on the bus)."""

    def __init__(self, url: str, source: str, reconnect_wait_s: float = 0.5,
                 auth: nats_auth.ClientAuth | None = None, sealers: Mapping[str, Sealer] | None = None,
                 tls: ssl.SSLContext | None = None, max_document_bytes: int = MAX_DOCUMENT_BYTES) -> None:
        """``auth``: credentials (default: ``WEFT_NATS_USER`` / ``WEFT_NATS_PASSWORD``);
        ``sealers``: kind -> function applied to each stamped event of that kind (default:
        ``heartbeat_signing.default_sealers()``); ``tls``: context for a server that
        requires TLS (default: trusts the mesh CA when one is configured);
        ``max_document_bytes``: larger live documents are refused unread (document_inbox.py)."""
        subject("x", source)  # validates the name
        self.url = url
        self.log_url = nats_auth.redact_url(url)
        self.auth = auth if auth is not None else nats_auth.ClientAuth.from_environ()
        self.tls = tls if tls is not None else nats_auth.mesh_tls_context()
        if sealers is None:
            from services.mesh.heartbeat_signing import default_sealers

            sealers = default_sealers()
        self._sealers = dict(sealers)
        self.source = source
        self.epoch = uuid.uuid4().hex
        self.reconnect_wait_s = reconnect_wait_s
        self._nc: NatsClient | None = None
        self._sequences: dict[str, int] = {}
        self._tracker = SequenceTracker()
        self._subs: list[_Subscription] = []
        self.max_document_bytes = max_document_bytes
        self._doc_subs: list[DocumentInbox] = []
        self._on_connect: list[Callable[[], Awaitable[None] | None]] = []
        self._connect_task: asyncio.Task | None = None
        self._connected = asyncio.Event()
        self._closed = False
        self._warned_unreachable = False
        self._warned: set[str] = set()  # (bounded) problems already logged at warning level
        self.login_refused = False  # the server refused this login (not: unreachable)
        self._first_attempt = asyncio.Event()  # the first connect attempt has an outcome
        self.num_published = 0
        self.num_dropped = 0
        self.num_disconnects = 0

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

    async def require_login(self, timeout_s: float = 5.0) -> None:
        """Raise ``nats_auth.NatsLoginRefused`` when the server refused this service's login on the
        first attempt: wrong user or password is a configuration error that retrying never
        fixes (an executor that cannot announce itself would look healthy and get no work).
        Returns when connected, when NATS is unreachable (an outage the bus rides out), or
        when the first attempt has no outcome within ``timeout_s``."""
        try:
            await asyncio.wait_for(self._first_attempt.wait(), timeout_s)
        except asyncio.TimeoutError:
            return
        if self.login_refused:
            raise nats_auth.NatsLoginRefused(
                f"NATS at {self.log_url} refused the login of user {self.auth.user or '(anonymous)'}: set "
                f"{nats_auth.USER_ENV} and {nats_auth.PASSWORD_ENV} to this service's role and its password")

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
        for inbox in self._doc_subs:
            await inbox.close()

    async def _connect_forever(self) -> None:
        attempt = 0
        while not self._closed:
            nc = NatsClient()
            login = {"user": self.auth.user, "password": self.auth.password} if self.auth.user else {}
            try:
                await nc.connect(
                    servers=[self.url], name=self.source, connect_timeout=1,
                    allow_reconnect=True, max_reconnect_attempts=-1,
                    reconnect_time_wait=self.reconnect_wait_s,
                    error_cb=self._on_error, disconnected_cb=self._on_disconnected,
                    reconnected_cb=self._on_reconnected, tls=self.tls, **login,
                )
            except Exception as exc:
                if attempt == 0:
                    self._log_connect_failure(exc)
                self._note_failed_attempt(exc)
                attempt += 1
                await asyncio.sleep(min(self.reconnect_wait_s * (1 + attempt / 4), 2.0))
                continue
            self._nc = nc
            self._warned_unreachable = False
            self.login_refused = False
            self._first_attempt.set()
            for sub in self._subs:
                await self._subscribe_on(nc, sub)
            for inbox in self._doc_subs:
                await self._subscribe_documents_on(nc, inbox)
            log.info("nats_connected", url=self.log_url, source=self.source, user=self.auth.user or None)
            user = self.auth.user
            if user in nats_auth.ROLES and self.auth.password == nats_auth.dev_fallback_password(user):
                log.warning("nats_password_is_the_public_fallback",
                            detail=f"set WEFT_NATS_{user.upper()}_PASSWORD for anything shared")
            self._connected.set()
            await self._fire_on_connect()
            return

    def _error_text(self, exc: BaseException) -> str:
        return nats_auth.redact(str(exc) or type(exc).__name__, self.auth.password)

    def _note_failed_attempt(self, exc: BaseException) -> None:
        """A connect attempt failed (raised by connect, or reported to the error callback
        while nats-py retries inside it): refused login or unreachable server. A refusal
        stays noted until a connect succeeds: nats-py reports it to the error callback and
        then raises a generic "no servers" error for the same attempt."""
        self.login_refused = self.login_refused or nats_auth.is_authorization_error(self._error_text(exc))
        self._first_attempt.set()

    def _log_connect_failure(self, exc: BaseException) -> None:
        error = self._error_text(exc)
        if nats_auth.is_authorization_error(error):
            log.error("nats_authorization_failed", url=self.log_url, user=self.auth.user or None, error=error,
                      detail=f"set {nats_auth.USER_ENV} and {nats_auth.PASSWORD_ENV} to this service's NATS role")
        else:
            log.warning("nats_unreachable", url=self.log_url, error=error)

    async def _on_error(self, exc: Exception) -> None:
        # nats-py retries connecting internally and reports each failure here: warn
        # once per outage, the rest at debug. A permission violation leaves the
        # connection up: warn once per message (it names the subject).
        if isinstance(exc, SlowConsumerError):
            return self._on_slow_consumer(exc)
        error = self._error_text(exc)
        if "permissions violation" in error.lower():
            self._warn_once(error, "nats_permission_violation", user=self.auth.user or None, error=error)
        elif not self.connected and not self._warned_unreachable:
            self._warned_unreachable = True
            self._note_failed_attempt(exc)
            self._log_connect_failure(exc)
        elif not self.connected:
            self._note_failed_attempt(exc)
        else:
            log.debug("nats_error", error=error)

    def _on_slow_consumer(self, exc: SlowConsumerError) -> None:
        """nats-py's queue for one subscription was full and it dropped a message; the
        connection stays up. A document's is counted by its inbox, logged rate-limited."""
        kind = (exc.subject or "").split(".")[1:2]
        inbox = next((i for i in self._doc_subs if [i.kind] == kind), None)
        if inbox is not None:
            inbox.drop("slow_consumer", subject=exc.subject)
        else:
            self._warn_once(f"slow consumer {kind}", "nats_slow_consumer", subject=exc.subject)

    def _warn_once(self, key: str, event: str, **fields) -> None:
        """Warn the first time ``key`` happens (at most 256 keys; then debug), so a
        flood of one refused or misaddressed message cannot flood the log."""
        if key in self._warned or len(self._warned) >= 256:
            log.debug(event, **fields)
            return
        self._warned.add(key)
        log.warning(event, **fields)

    async def _on_disconnected(self) -> None:
        self._connected.clear()
        self.num_disconnects += 1
        if not self._closed:
            log.warning("nats_disconnected", url=self.log_url)

    async def _on_reconnected(self) -> None:
        self._connected.set()
        self._warned_unreachable = False
        log.info("nats_reconnected", url=self.log_url)
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
        seal = self._sealers.get(kind)
        if seal is not None:
            seal(message)
        return await self._send(kind, message.SerializeToString())

    async def _send(self, kind: str, data: bytes) -> bool:
        nc = self._nc
        if nc is None or not nc.is_connected:
            return self._drop(kind)
        try:
            await nc.publish(subject(kind, self.source), data)
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

    # -- documents: whole JSON documents, not events (live_settings.py) ---------------
    async def publish_document(self, kind: str, data: bytes) -> bool:
        """Send ``data`` on ``weft.<kind>.<source>`` as it is (no header, no sequence: the
        document carries its own version). Never raises; False when dropped, also when
        over ``max_document_bytes`` (every receiver would refuse it: logged here once)."""
        if len(data) > self.max_document_bytes:
            self._warn_once(f"too large {kind}", "document_too_large", kind=kind, size_bytes=len(data),
                            max_bytes=self.max_document_bytes)
            return self._drop(kind)
        return await self._send(kind, data)

    async def subscribe_documents(self, kind: str, handler: DocumentHandler, screen: DocumentScreen | None = None,
                                  order: DocumentOrder | None = None) -> None:
        """Hand the newest document of each ``weft.<kind>.*`` subject to ``handler(data)``,
        one at a time; survives reconnects. Older ones still waiting are dropped, and so
        are any over ``max_document_bytes`` (document_inbox.py: a flood of big documents
        must not get this connection cut off as a slow consumer), ``screen(subject, data)``
        refuses (``DocumentSeal.admits``) or ``order(data)`` puts before the one waiting."""
        inbox = DocumentInbox(kind, handler, max_bytes=self.max_document_bytes, screen=screen, order=order)
        self._doc_subs.append(inbox)
        if self.connected:
            await self._subscribe_documents_on(self._nc, inbox)

    def num_documents_settled(self, kind: str) -> int:
        """Documents of ``kind`` heard and then handled or dropped (superseded, ...)."""
        return sum(i.num_handled + i.num_dropped for i in self._doc_subs if i.kind == kind)

    async def _subscribe_documents_on(self, nc: NatsClient, inbox: DocumentInbox) -> None:
        async def on_message(msg) -> None:
            EVENTS_RECEIVED.labels(inbox.kind).inc()
            inbox.offer(msg.subject, msg.data)

        await nc.subscribe(f"weft.{inbox.kind}.*", cb=on_message, **NATS_PENDING_LIMITS)

    # -- subscribing ----------------------------------------------------------------
    async def subscribe(self, kind: str, message_cls: type[Message], handler: Handler, source: str = "*",
                        accept: Callable[[Message], bool] | None = None) -> None:
        """Deliver events of ``kind`` (from ``source`` or all) to ``handler(msg, delivery)``,
        duplicates removed. ``accept`` (e.g. a signature check) filters events before
        their sequence is tracked, so a refused event cannot mark a stream restarted or
        make the real events look like duplicates. Survives reconnects; may be called
        before NATS is up."""
        sub = _Subscription(kind, source, message_cls, handler, accept)
        self._subs.append(sub)
        if self.connected:
            await self._subscribe_on(self._nc, sub)

    async def _subscribe_on(self, nc: NatsClient, sub: _Subscription) -> None:
        async def on_message(msg) -> None:
            await self._receive(sub, msg.subject, msg.data)

        await nc.subscribe(f"weft.{sub.kind}.{sub.source}", cb=on_message)

    async def _receive(self, sub: _Subscription, subj: str, data: bytes) -> Delivery | None:
        """Decode, check the claimed source against the subject, ``accept``, deliver;
        None when dropped before delivery."""
        try:
            event = sub.message_cls.FromString(data)
        except DecodeError:
            log.warning("event_malformed", subject=subj)
            return None
        if not addressed_from(subj, sub.kind, event.header.source):
            EVENTS_MISADDRESSED.labels(sub.kind).inc()
            self._warn_once(f"misaddressed {subj}", "event_misaddressed", subject=subj,
                            source=event.header.source[:64])
            return None
        if sub.accept is not None and not sub.accept(event):
            return None
        return await self.deliver(sub.kind, event, sub.handler)

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
