"""Admission: at most ``max_in_flight`` requests stream at once; up to ``max_queue``
more wait in FIFO order; beyond that a request is refused at once with a retry hint.

A waiter that is cancelled (client gone, deadline) leaves the queue; a slot handed to
a waiter that was cancelled in the same instant is passed on, never leaked.
"""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
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

    async def enter(self) -> None:
        """Take an in-flight slot, waiting in the queue if needed; raises OverloadedError
        when the queue is full. Cancellation while waiting leaves the queue."""
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

    def leave(self) -> None:
        """Give back a slot: to the oldest live waiter, else to the pool."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
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
