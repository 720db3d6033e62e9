"""Live documents heard on the bus: the newest per subject, handled at a bounded pace.

A document (services/mesh/live_settings.py) is a whole state, so only the newest one from
each publisher matters. A flood of big ones (any client allowed to publish the subject can
send ~1 MiB each as fast as loopback carries them) used to be queued whole and parsed one
after another on the event loop. The loop then read its socket no faster than it parsed,
nats-server's buffer for the connection passed ``max_pending`` (64 MiB) and the server cut
the whole connection off as a slow consumer, heartbeats, kv events and every other
subscription with it (issue 17).

NOTE: one slot per subject. A document takes its subject's slot (the one it replaces is
dropped, ``superseded``); a worker hands the slots to the handler in the order their
subjects arrived and, after each, pauses ``PAUSE_RATIO`` times as long as the handler took,
so documents get at most a quarter of the event loop and the socket is read in the rest. Bounds: a
document over ``max_bytes`` is refused unread (``too_large``); at most ``max_subjects``
slots wait, a new subject beyond them is dropped (``overflow``). With a mesh secret,
``screen`` checks each document's signature before it takes a slot (settings_signing.py:
an HMAC over the raw bytes, no parsing); one that fails is dropped (``refused``), so junk
on a publisher's own subject never supersedes its pending document. ``order`` gives a
document's send time (the signed ``sent_at``): one sent before the document waiting on its
subject is dropped (``older``), so a replayed capture of a router's earlier republish,
genuine and fresh enough to pass the screen, cannot push out the change waiting behind it
either (found by attack). Only the waiting document is compared, not a history, so a
sender whose clock steps back is never locked out. Nothing is lost for
good: routers republish their newest document every few seconds
(services/router/live_settings.py), so a dropped one comes again, and a flood on one
subject never takes another subject's slot.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import structlog

from services.mesh import metrics
from services.mesh.rate_limited_log import RateLimitedLog

log = structlog.get_logger(__name__)

MAX_DOCUMENT_BYTES = 512 * 1024  # a router's document with ~6,000 API keys (signed); NATS's max_payload: 1 MiB
MAX_PENDING_SUBJECTS = 64  # routers publish each on its own subject: far more than a mesh runs
PAUSE_RATIO = 3.0  # after a document, pause 3x its handling: 25 % of the loop (measured: 1x lost the
# connection in 2 of 9 floods of 90 MB on a loaded 2-core machine)
DROP_LOG_INTERVAL_S = 10.0  # one line per reason and period, however many are dropped
DROP_REASONS = ("superseded", "too_large", "refused", "older", "overflow", "slow_consumer")
# nats-py's own queue in front of ``offer`` (which is O(1)): bytes above NATS's 1 MiB
# max_payload, else a message of that size could never be queued; nats-py drops beyond
# these and reports SlowConsumerError, counted here as ``slow_consumer`` (nats_bus.py)
NATS_PENDING_LIMITS = {"pending_msgs_limit": 64, "pending_bytes_limit": 8 << 20}
DOCUMENTS_DROPPED = metrics.counter("weft_documents_dropped_total",
                                    "Live documents dropped before their handler (docs/live_config.md).",
                                    ["kind", "reason"])

DocumentHandler = Callable[[bytes], Awaitable[bool | None]]  # True: accepted (signed, well formed)
DocumentScreen = Callable[[str, bytes], bool]  # (subject, data) -> may take a slot (counts its own refusals)
DocumentOrder = Callable[[bytes], float]  # a screened document's send time (equal for all: last one wins)


class DocumentInbox:
    """The documents of one kind waiting for ``handler``; ``offer`` never blocks."""

    def __init__(self, kind: str, handler: DocumentHandler, max_bytes: int = MAX_DOCUMENT_BYTES,
                 max_subjects: int = MAX_PENDING_SUBJECTS, clock: Callable[[], float] = time.monotonic,
                 screen: DocumentScreen | None = None, order: DocumentOrder | None = None) -> None:
        """``screen``: checked before a document takes a slot (None: every document may);
        ``order``: a document older than the one waiting on its subject is dropped (None:
        the last one heard always wins)."""
        if max_bytes <= 0 or max_subjects <= 0:
            raise ValueError("max_bytes and max_subjects must be > 0")
        self.kind = kind
        self.max_bytes = max_bytes
        self.max_subjects = max_subjects
        self._handler = handler
        self._screen = screen
        self._order = order
        self._sent: dict[str, float] = {}  # subject -> its waiting document's ``order``
        self._clock = clock
        self._pending: dict[str, bytes] = {}  # subject -> its newest document; order: first arrival
        self._accepted: dict[str, None] = {}  # subjects whose last handled document was accepted (LRU, bounded)
        self._closed = False
        self._ready = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._log_drop = RateLimitedLog("documents_dropped", DROP_LOG_INTERVAL_S, logger=log)
        self.num_handled = 0
        self.num_dropped = 0

    def offer(self, subject: str, data: bytes) -> bool:
        """Keep ``data`` as ``subject``'s newest document (mutates the slots; starts the
        worker if needed). False when ``data`` itself is dropped (counted, logged rate-limited)."""
        if self._closed:
            return False
        if len(data) > self.max_bytes:
            return self.drop("too_large", subject=subject, size_bytes=len(data), max_bytes=self.max_bytes)
        if self._screen is not None and not self._screen(subject, data):
            return self.drop("refused", subject=subject)  # the slot keeps what it holds
        sent = self._order(data) if self._order is not None else 0.0
        if subject in self._pending:
            if sent < self._sent.get(subject, 0.0):
                return self.drop("older", subject=subject)  # a replay: the newer one keeps the slot
            self.drop("superseded", subject=subject)  # the older one goes; this one takes the slot
        elif len(self._pending) >= self.max_subjects:
            # a subject that carried an accepted document takes the slot of the oldest one that did not
            victim = next((s for s in self._pending if s not in self._accepted), None) \
                if subject in self._accepted else None
            if victim is None:
                return self.drop("overflow", subject=subject, max_subjects=self.max_subjects)
            del self._pending[victim]
            self._sent.pop(victim, None)
            self.drop("overflow", subject=victim, max_subjects=self.max_subjects)
        self._pending[subject] = data
        self._sent[subject] = sent
        self._ready.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"weft-documents-{self.kind}")
        return True

    def drop(self, reason: str, **fields) -> bool:
        """Count one document of this kind dropped for ``reason`` (one of DROP_REASONS)."""
        self.num_dropped += 1
        DOCUMENTS_DROPPED.labels(self.kind, reason).inc()
        self._log_drop(reason, kind=self.kind, **fields)
        return False

    async def close(self) -> None:
        """Stop the worker; documents still waiting are discarded."""
        self._closed = True
        task, self._task = self._task, None
        self._pending.clear()
        self._sent.clear()
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._pending:
                subject = next(iter(self._pending))
                data = self._pending.pop(subject)
                self._sent.pop(subject, None)
                started = self._clock()
                accepted = False
                try:
                    accepted = await self._handler(data) is True
                except asyncio.CancelledError:
                    if asyncio.current_task().cancelling():
                        raise  # close(): the worker itself is cancelled
                    log.exception("document_handler_failed", kind=self.kind, subject=subject)
                except Exception:
                    log.exception("document_handler_failed", kind=self.kind, subject=subject)
                self._accepted.pop(subject, None)
                if accepted:
                    self._accepted[subject] = None
                    if len(self._accepted) > self.max_subjects:
                        del self._accepted[next(iter(self._accepted))]
                self.num_handled += 1
                # the rest of the loop: reading the socket (the module's NOTE)
                await asyncio.sleep(PAUSE_RATIO * max(0.0, self._clock() - started))
