"""Per-tenant admission in front of the scheduler-wide one.

    request ─▶ tenant t's Admission (in flight ≤ per-tenant cap, FIFO queue ≤ per-tenant cap)
            ─▶ scheduler-wide Admission (in flight ≤ global cap, queue ≤ global cap)

A tenant that floods fills *its own* queue and then gets RESOURCE_EXHAUSTED with a retry
hint, while its in-flight share stays at its cap; so as long as the per-tenant caps are
below the global ones, another tenant always finds room in the global pool and its
requests are admitted in their order, unaffected by the flood. Tenants without work
hold no state (entries are dropped when idle, so tenant names cannot grow memory).
"""
from __future__ import annotations

from services.scheduler.policy.admission import Admission
from services.scheduler.errors import OverloadedError


class TenantAdmission:
    """``enter(tenant)`` / ``leave(tenant)`` pairs; mutates both levels' counts."""

    def __init__(self, admission: Admission, max_in_flight_per_tenant: int, max_queue_per_tenant: int,
                 retry_after_ms: int | None = None) -> None:
        if max_in_flight_per_tenant < 1 or max_queue_per_tenant < 0:
            raise ValueError("max_in_flight_per_tenant must be >= 1 and max_queue_per_tenant >= 0")
        self.admission = admission
        self.max_in_flight_per_tenant = max_in_flight_per_tenant
        self.max_queue_per_tenant = max_queue_per_tenant
        self.retry_after_ms = retry_after_ms or admission.base_retry_after_ms
        self._tenants: dict[str, Admission] = {}
        self._num_holders: dict[str, int] = {}

    @property
    def num_tenants(self) -> int:
        """Tenants with requests in flight or queued (does not modify)."""
        return len(self._tenants)

    def load_fraction(self) -> float:
        """Scheduler-wide occupancy in [0, 1]: the degradation ladder's admission signal."""
        a = self.admission
        return min(1.0, (a.num_in_flight + a.num_queued) / (a.max_in_flight + a.max_queue))

    async def enter(self, tenant: str, score=None) -> None:
        """Take a tenant slot, then a global one (waiting in each queue); raises
        OverloadedError when either queue is full. Cancellation gives both back.
        ``score``: the request's sort key in the global queue, lower first (admission.py)."""
        own = self._tenants.get(tenant)
        if own is None:
            own = self._tenants[tenant] = Admission(self.max_in_flight_per_tenant, self.max_queue_per_tenant,
                                                    self.retry_after_ms)
        self._num_holders[tenant] = self._num_holders.get(tenant, 0) + 1
        try:
            try:
                await own.enter()
            except OverloadedError as exc:
                raise OverloadedError(f"tenant {tenant!r} over its limit: {exc}", exc.retry_after_ms) from None
            try:
                await self.admission.enter(score)
            except BaseException:
                own.leave()
                raise
        except BaseException:
            self._release(tenant)
            raise

    def leave(self, tenant: str) -> None:
        self.admission.leave()
        self._tenants[tenant].leave()
        self._release(tenant)

    def _release(self, tenant: str) -> None:
        left = self._num_holders[tenant] - 1
        if left:
            self._num_holders[tenant] = left
        else:
            del self._num_holders[tenant]
            del self._tenants[tenant]
