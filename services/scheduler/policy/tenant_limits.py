"""Per-tenant limits, kept inside the one scored queue (admission.py).

    request ─▶ Admission: one queue of every tenant's waiters
               a slot goes to the waiting tenant with the fewest in flight per unit of
               weight (weighted fair share; weight 1 unless ``tenant_weights`` says),
               and within it to the waiter the scheduling policy ranks first

A tenant that floods fills *its own* allowance (``max_in_flight_per_tenant +
max_queue_per_tenant`` requests in flight or waiting, as when its queue stood in front)
and then gets RESOURCE_EXHAUSTED with a retry hint, while its in-flight count stays at its
cap (``max_in_flight_per_tenant``) and, whenever others wait, at its fair share; another
tenant's requests are admitted in their policy order, unaffected by the flood. There is
no per-tenant FIFO in front of the scored queue, so the policy's order holds for one
tenant too. Tenants without work hold no state (names cannot grow memory).
"""
from __future__ import annotations

import math
from collections.abc import Mapping

from services.scheduler.policy.admission import Admission, Score


def parse_tenant_weights(text: str) -> dict[str, float]:
    """``"acme=2,globex=0.5"`` → each tenant's fair-share weight (positive, finite);
    tenants not named weigh 1. Raises ValueError naming the item."""
    out: dict[str, float] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = item.partition("=")
        try:
            weight = float(value) if sep and name.strip() else math.nan
        except ValueError:
            weight = math.nan
        if not 0 < weight < math.inf:
            raise ValueError(f"tenant weight {item!r}: expected name=weight with a positive number")
        out[name.strip()] = weight
    return out


class TenantAdmission:
    """``enter(tenant)`` / ``leave(tenant)`` pairs over one ``Admission`` configured with
    the per-tenant caps and weights; mutates the admission's counts and queue."""

    def __init__(self, admission: Admission, max_in_flight_per_tenant: int, max_queue_per_tenant: int,
                 weights: Mapping[str, float] | None = None) -> None:
        admission.limit_tenants(max_in_flight_per_tenant, max_queue_per_tenant)
        admission.weight_tenants(weights or {})
        self.admission = admission

    @property
    def num_tenants(self) -> int:
        """Tenants with requests in flight or queued (does not modify)."""
        return self.admission.num_tenants

    def load_fraction(self) -> float:
        """Occupancy in [0, 1] (Admission.load_fraction): the ladder's admission signal."""
        return self.admission.load_fraction()

    async def enter(self, tenant: str, score: Score | None = None) -> None:
        """Take a slot for ``tenant``, waiting in the scored queue; raises OverloadedError
        when its share of the queue or the whole queue is full. ``score``: the request's
        sort key, lower first (admission.py); None: arrival order."""
        await self.admission.enter(score, tenant)

    def leave(self, tenant: str) -> None:
        self.admission.leave(tenant)
