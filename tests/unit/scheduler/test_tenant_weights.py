"""Tenant weights in the scored queue's fair share: under contention a weight-2 tenant
holds twice the slots of a weight-1 tenant, and is handed twice the dispatches; tenants
not named weigh 1 (equal shares, as before weights existed)."""
from __future__ import annotations

import asyncio
from collections import Counter, deque

import pytest

from services.scheduler.config import SchedulerConfig
from services.scheduler.policy.admission import Admission
from services.scheduler.policy.tenant_limits import TenantAdmission, parse_tenant_weights


def dispatch_order(weights: dict[str, float], num_slots: int = 3, num_each: int = 30,
                   num_served: int = 30) -> tuple[list[str], list[Counter]]:
    """Two tenants queue ``num_each`` requests each (interleaved arrivals) behind a full
    queue; every request holds its slot until the oldest in service finishes. Returns
    the tenants in grant order and the slots each holds after every grant."""
    async def main():
        admission = Admission(num_slots, 1000)
        slots = TenantAdmission(admission, num_slots, 1000, weights=weights)
        for _ in range(num_slots):
            await slots.enter("blocker")
        in_service = deque(["blocker"] * num_slots)
        granted: list[str] = []
        holding: list[Counter] = []

        async def request(tenant: str) -> None:
            await slots.enter(tenant)
            granted.append(tenant)
            in_service.append(tenant)
            holding.append(Counter(in_service))

        tasks = [asyncio.create_task(request(t)) for _ in range(num_each) for t in ("light", "heavy")]
        await asyncio.sleep(0)  # every request is queued (the slots are full)
        assert admission.num_queued == 2 * num_each
        while len(granted) < num_served:
            slots.leave(in_service.popleft())
            await asyncio.sleep(0)  # the granted request records itself
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return granted, holding
    return asyncio.run(asyncio.wait_for(main(), 10))


def test_a_weight_2_tenant_gets_twice_the_dispatch_share_under_contention():
    granted, holding = dispatch_order({"heavy": 2})
    counts = Counter(granted)
    assert counts == {"heavy": 20, "light": 10}
    # Once the blockers are gone, the slots are held 2:1 at every hand-off.
    settled = [h for h in holding if not h["blocker"]]
    assert settled and all((h["heavy"], h["light"]) == (2, 1) for h in settled)


def test_unweighted_tenants_share_equally():
    granted, _ = dispatch_order({}, num_slots=2)
    assert Counter(granted) == {"heavy": 15, "light": 15}


def test_weights_only_matter_under_contention():
    async def main():
        admission = Admission(4, 10)
        slots = TenantAdmission(admission, 4, 10, weights={"heavy": 3})
        for _ in range(4):
            await slots.enter("light")  # a lone tenant may still take every slot
        return admission.num_in_flight
    assert asyncio.run(main()) == 4


def test_tenant_weights_parse_like_quotas_and_refuse_nonsense():
    assert parse_tenant_weights(" acme=2, globex=0.5 ,") == {"acme": 2.0, "globex": 0.5}
    for bad in ("acme", "acme=0", "acme=-1", "acme=x", "=2", "acme=inf", "acme=nan"):
        with pytest.raises(ValueError, match="tenant weight"):
            parse_tenant_weights(bad)
    with pytest.raises(ValueError, match="tenant weight"):
        Admission(1, 1).weight_tenants({"acme": 0.0})


def test_the_scheduler_refuses_bad_tenant_weights_at_start():
    assert SchedulerConfig(tenant_weights="acme=2").tenant_weights == "acme=2"
    with pytest.raises(ValueError, match="acme=zero"):
        SchedulerConfig(tenant_weights="acme=zero")
