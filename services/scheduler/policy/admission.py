"""Admission: one scored queue in front of the executors, fair across tenants.

At most ``in_flight_cap`` requests stream at once (``max_in_flight``, lowered to what
the executors can run by ``limit_in_flight``; each tenant at most
``max_in_flight_per_tenant``); up to ``max_queue`` more wait, and a tenant holds at most
``max_in_flight_per_tenant + max_queue_per_tenant`` requests in flight or waiting; beyond
that a request is refused at once with a retry hint.
Bounding in-flight by the executors' batch slots keeps the backlog *here*, where the
order below applies, instead of in an executor's queue that knows no tenants.

NOTE (one queue, two levels of order). Every waiter of every tenant sits in the one
queue. When a slot frees, it goes to

    tenant  = argmin over tenants with an eligible waiter of  ((in_flight[t] + 1) / weight[t], best key of t)
    waiter  = argmin over that tenant's waiters of            (key(now), arrival)

where a waiter is eligible while its tenant is under its in-flight cap, ``weight[t]`` is
the tenant's weight (``weight_tenants``; 1 unless set) and ``key`` is the waiter's
``score`` (a function of now; lower first) or −inf when it brought none (then arrival
order). So slots are shared among the tenants that are waiting in proportion to their
weights (equally by default: a flood of one tenant cannot take more than its share
from another; a weight-2 tenant holds twice a weight-1 tenant's slots), and within a
tenant the scheduling policy's score decides: the dispatcher hands
``queue_order_key(priority)`` (services/shared/vocabulary.py), re-estimated at every
hand-off, so dynamic priority and its aging act on every decision. With one tenant
this is exactly the policy's order. O(queue) per hand-off: queues here are small.

A waiter that is cancelled (client gone, deadline) leaves the queue; a slot handed to
a waiter that was cancelled in the same instant is passed on, never leaked.
"""
from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from services.scheduler.errors import OverloadedError

Score = Callable[[float], float]


@dataclass(eq=False)
class _Waiter:
    tenant: str
    score: Score | None
    seq: int  # arrival order
    future: asyncio.Future = field(repr=False)

    def key(self, now: float) -> tuple[float, int]:
        return (self.score(now) if self.score is not None else float("-inf"), self.seq)


class Admission:
    """``enter`` / ``leave`` pairs (same tenant); both mutate the counts and the queue.
    Read-only: ``num_in_flight``, ``num_queued``, ``num_ahead``, ``load_fraction``."""

    def __init__(self, max_in_flight: int, max_queue: int, retry_after_ms: int = 200, *,
                 max_in_flight_per_tenant: int | None = None, max_queue_per_tenant: int | None = None) -> None:
        if max_in_flight < 1 or max_queue < 0:
            raise ValueError("max_in_flight must be >= 1 and max_queue >= 0")
        self.max_in_flight = max_in_flight
        self.max_queue = max_queue
        self.base_retry_after_ms = retry_after_ms
        self.limit_tenants(max_in_flight_per_tenant or max_in_flight,
                           max_queue if max_queue_per_tenant is None else max_queue_per_tenant)
        self.in_flight_cap = max_in_flight
        self.num_in_flight = 0
        self._waiters: list[_Waiter] = []
        self._in_flight: dict[str, int] = {}  # per tenant; tenants with none are dropped
        self._queued: dict[str, int] = {}
        self._seq = itertools.count()
        self._weights: dict[str, float] = {}
        self.clock = time.monotonic

    def weight_tenants(self, weights: Mapping[str, float]) -> None:
        """Set the tenants' fair-share weights (tenants not named: 1). Replaces the whole
        table; raises ValueError for a weight that is not a positive finite number."""
        for tenant, w in weights.items():
            if not 0 < w < math.inf:
                raise ValueError(f"tenant weight of {tenant!r} must be a positive finite number, got {w}")
        self._weights = dict(weights)
        self._hand_out()

    def weight(self, tenant: str) -> float:
        """The tenant's fair-share weight (1 unless set). Does not modify."""
        return self._weights.get(tenant, 1.0)

    def limit_tenants(self, max_in_flight_per_tenant: int, max_queue_per_tenant: int) -> None:
        """Set the per-tenant caps (configuration, before requests arrive)."""
        if max_in_flight_per_tenant < 1 or max_queue_per_tenant < 0:
            raise ValueError("max_in_flight_per_tenant must be >= 1 and max_queue_per_tenant >= 0")
        self.max_in_flight_per_tenant = max_in_flight_per_tenant
        self.max_queue_per_tenant = max_queue_per_tenant

    def limit_in_flight(self, num_slots: int | None) -> None:
        """Lower the in-flight cap to ``num_slots`` (what the executors can run now; None
        or 0: unknown, no lower cap), then hand any newly free slots to waiters."""
        self.in_flight_cap = min(self.max_in_flight, num_slots) if num_slots else self.max_in_flight
        self._hand_out()

    @property
    def max_per_tenant(self) -> int:
        """Requests one tenant may hold in flight or waiting."""
        return self.max_in_flight_per_tenant + self.max_queue_per_tenant

    @property
    def num_queued(self) -> int:
        return len(self._waiters)

    @property
    def num_tenants(self) -> int:
        """Tenants with requests in flight or queued (does not modify)."""
        return len(self._in_flight.keys() | self._queued.keys())

    def retry_after_ms(self) -> int:
        """Hint grows with how far over capacity the queue is (>= the base)."""
        backlog = (self.num_queued + self.num_in_flight) / self.in_flight_cap
        return int(self.base_retry_after_ms * max(1.0, backlog))

    def can_enter(self, tenant: str = "") -> bool:
        """Whether a request would be admitted (now or after queueing). Does not modify."""
        return self._refusal(tenant) is None

    def load_fraction(self) -> float:
        """Occupancy in [0, 1]: in flight and queued over the in-flight cap (as lowered to
        the executors' slots) plus ``max_queue``; the degradation ladder's admission signal.
        The whole mesh's, not a tenant's: a tenant at its own caps is refused by them, and
        must not shed other tenants' requests of its class. Does not modify."""
        return min(1.0, (self.num_in_flight + self.num_queued) / (self.in_flight_cap + self.max_queue))

    def num_ahead(self, score: float) -> int:
        """Waiters that would be served before a request scoring ``score`` now (any tenant)."""
        now = self.clock()
        return sum(1 for w in self._waiters if w.key(now)[0] <= score)

    async def enter(self, score: Score | None = None, tenant: str = "") -> None:
        """Take an in-flight slot, waiting in the queue if needed; raises OverloadedError
        when the tenant's or the global queue is full. Cancellation while waiting leaves
        the queue. ``score``: the waiter's key as a function of now (lower first); None:
        arrival order."""
        if self.num_in_flight < self.in_flight_cap and self._can_run(tenant):
            self._take(tenant)  # a free slot means no eligible waiter: leave() hands them out
            return
        refusal = self._refusal(tenant)
        if refusal is not None:
            raise OverloadedError(refusal, retry_after_ms=self.retry_after_ms())
        waiter = _Waiter(tenant, score, next(self._seq), asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self._queued[tenant] = self._queued.get(tenant, 0) + 1
        try:
            await waiter.future  # resolved by _hand_out(): the slot is already counted as ours
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self.leave(tenant)  # we were handed a slot but will not use it
            else:
                self._dequeue(waiter)
            raise

    def leave(self, tenant: str = "") -> None:
        """Give back a slot, then hand free slots to the waiters next in order."""
        held = self._in_flight.get(tenant, 0)
        if held <= 0 or self.num_in_flight <= 0:
            raise ValueError(f"leave() without a matching enter() (tenant {tenant!r})")
        self._decrement(self._in_flight, tenant)
        self.num_in_flight -= 1
        self._hand_out()

    def _can_run(self, tenant: str) -> bool:
        return self._in_flight.get(tenant, 0) < self.max_in_flight_per_tenant

    def _refusal(self, tenant: str) -> str | None:
        if self.num_in_flight < self.in_flight_cap and self._can_run(tenant):
            return None
        if self._in_flight.get(tenant, 0) + self._queued.get(tenant, 0) >= self.max_per_tenant:
            return (f"tenant {tenant!r} over its limit: {self._in_flight.get(tenant, 0)} in flight, "
                    f"{self._queued.get(tenant, 0)} queued")
        if self.num_queued >= self.max_queue:
            return f"scheduler full: {self.num_in_flight} in flight, {self.num_queued} queued"
        return None

    def _take(self, tenant: str) -> None:
        self._in_flight[tenant] = self._in_flight.get(tenant, 0) + 1
        self.num_in_flight += 1

    def _hand_out(self) -> None:
        while self.num_in_flight < self.in_flight_cap:
            waiter = self._next_waiter()
            if waiter is None:
                return
            self._dequeue(waiter)
            self._take(waiter.tenant)
            waiter.future.set_result(None)

    def _next_waiter(self) -> _Waiter | None:
        """The fair-share choice of the NOTE above. Does not modify."""
        now = self.clock()
        best_of: dict[str, tuple[tuple[float, int], _Waiter]] = {}
        for w in self._waiters:
            if w.future.done() or not self._can_run(w.tenant):
                continue
            k = w.key(now)
            if w.tenant not in best_of or k < best_of[w.tenant][0]:
                best_of[w.tenant] = (k, w)
        if not best_of:
            return None
        tenant = min(best_of, key=lambda t: ((self._in_flight.get(t, 0) + 1) / self.weight(t), best_of[t][0]))
        return best_of[tenant][1]

    def _dequeue(self, waiter: _Waiter) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            return
        self._decrement(self._queued, waiter.tenant)

    @staticmethod
    def _decrement(counts: dict[str, int], tenant: str) -> None:
        left = counts[tenant] - 1
        if left:
            counts[tenant] = left
        else:
            del counts[tenant]

    @asynccontextmanager
    async def slot(self, tenant: str = "") -> AsyncIterator[None]:
        await self.enter(tenant=tenant)
        try:
            yield
        finally:
            self.leave(tenant)
