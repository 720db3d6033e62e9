"""Per-stream ordering of bus events: dedupe, gap and restart detection.

NOTE (ordering): NATS core delivers one publisher's messages to one subscriber in
order, so per stream (one subject: a (kind, source) pair) a sequence <= the last one seen
is a duplicate, one more is in order, anything larger is a gap; a new ``epoch`` means the
source restarted. Pure bookkeeping, no I/O; ``nats_bus.EventBus`` applies it to every
received event.
"""
from __future__ import annotations

import enum


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
