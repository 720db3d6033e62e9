"""Admission: at most ``max_in_flight`` requests stream at once; up to ``max_queue``
more wait; beyond that a request is refused at once with a retry hint.

Waiters are served in FIFO order unless they bring a ``score`` (a function of the
current time; lower goes first): then each freed slot goes to the waiter with the
lowest score *at that moment*, so dynamic priorities are re-estimated at every
scheduling decision (``priority.py``). A score is an ascending sort key: the
dispatcher hands ``queue_order_key(priority)`` (services/shared/vocabulary.py), the one
place a priority (higher runs first) changes sign. O(queue) per hand-off: queues here
are small.

A waiter that is cancelled (client gone, deadline) leaves the queue; a slot handed to
a waiter that was cancelled in the same instant is passed on, never leaked.
"""
from __future__ import annotations

import asyncio
from collections import deque
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from services.scheduler.errors import OverloadedError


class Admission:
    def __init__(self, max_in_flight: int, max_queue: int, retry_after_ms: int = 200) -> None:
        if max_in_flight < 1 or max_queue < 0:
            raise ValueError("max_in_flight must be >= 1 and max_queue >= 0")
        self.max_in_flight = max_in_flight
        self.max_queue = max_queue
        self.base_retry_after_ms = retry_after_ms
        self.num_in_flight = 0
        self._waiters: deque[asyncio.Future] = deque()
        self._scores: dict[asyncio.Future, Callable[[float], float]] = {}
        self.clock = time.monotonic

    @property
    def num_queued(self) -> int:
        return len(self._waiters)

    def retry_after_ms(self) -> int:
        """Hint grows with how far over capacity the queue is (>= the base)."""
        backlog = (self.num_queued + self.num_in_flight) / self.max_in_flight
        return int(self.base_retry_after_ms * max(1.0, backlog))

    def can_enter(self) -> bool:
        """Whether a request would be admitted (now or after queueing). Does not modify."""
        return self.num_in_flight < self.max_in_flight or self.num_queued < self.max_queue

    def num_ahead(self, score: float) -> int:
        """Waiters that would be served before a request scoring ``score`` now."""
        now = self.clock()
        return sum(1 for f in self._waiters if not f.done() and self._scores.get(f, lambda _: 0.0)(now) <= score)

    async def enter(self, score: Callable[[float], float] | None = None) -> None:
        """Take an in-flight slot, waiting in the queue if needed; raises OverloadedError
        when the queue is full. Cancellation while waiting leaves the queue. ``score``:
        the waiter's priority as a function of now (lower first); None: FIFO."""
        if self.num_in_flight < self.max_in_flight and not self._waiters:
            self.num_in_flight += 1
            return
        if self.num_queued >= self.max_queue:
            raise OverloadedError(
                f"scheduler full: {self.num_in_flight} in flight, {self.num_queued} queued",
                retry_after_ms=self.retry_after_ms(),
            )
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        if score is not None:
            self._scores[fut] = score
        try:
            await fut  # resolved by leave(): the slot is handed over, num_in_flight unchanged
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.leave()  # we were handed a slot but will not use it
            else:
                try:
                    self._waiters.remove(fut)
                except ValueError:
                    pass
            raise
        finally:
            self._scores.pop(fut, None)

    def leave(self) -> None:
        """Give back a slot: to the live waiter with the lowest score now (the oldest
        when none is scored), else to the pool."""
        if self._scores:
            self._hand_to_best()
            return
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        if self.num_in_flight <= 0:
            raise ValueError("leave() without a matching enter()")
        self.num_in_flight -= 1

    def _hand_to_best(self) -> None:
        now = self.clock()
        live = [f for f in self._waiters if not f.done()]
        if not live:
            self._waiters.clear()
            self._leave_to_pool()
            return
        # Unscored waiters keep FIFO among themselves and rank by arrival (-inf: first).
        best = min(live, key=lambda f: self._scores[f](now) if f in self._scores else float("-inf"))
        self._waiters.remove(best)
        best.set_result(None)

    def _leave_to_pool(self) -> None:
        if self.num_in_flight <= 0:
            raise ValueError("leave() without a matching enter()")
        self.num_in_flight -= 1

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        await self.enter()
        try:
            yield
        finally:
            self.leave()
