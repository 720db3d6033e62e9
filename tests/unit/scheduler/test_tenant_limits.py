"""Per-tenant admission: a flooding tenant is refused while another is still admitted."""
from __future__ import annotations

import asyncio

import pytest

from services.scheduler.policy.admission import Admission
from services.scheduler.errors import OverloadedError
from services.scheduler.policy.tenant_limits import TenantAdmission


def test_flooding_tenant_gets_overloaded_while_another_tenant_is_admitted_in_order():
    async def main():
        limits = TenantAdmission(Admission(max_in_flight=4, max_queue=8), max_in_flight_per_tenant=2,
                                 max_queue_per_tenant=2)
        flood = [asyncio.create_task(limits.enter("flood")) for _ in range(20)]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        refused = [t for t in flood if t.done() and isinstance(t.exception(), OverloadedError)]
        assert len(refused) == 16  # 2 in flight + 2 queued per tenant
        assert "tenant 'flood'" in str(refused[0].exception()) and refused[0].exception().retry_after_ms > 0
        # The polite tenant is admitted at once despite the flood.
        await asyncio.wait_for(limits.enter("polite"), 1)
        await asyncio.wait_for(limits.enter("polite"), 1)
        assert limits.admission.num_in_flight == 4
        for _ in range(2):
            limits.leave("polite")
        for _ in range(2):
            limits.leave("flood")  # the two queued flood requests take the freed slots
        waiting = [t for t in flood if not t.done()]
        await asyncio.wait_for(asyncio.gather(*[t for t in flood if t not in refused]), 1)
        assert not waiting or all(t.done() for t in waiting)
        for _ in range(2):
            limits.leave("flood")
        assert limits.num_tenants == 0 and limits.admission.num_in_flight == 0
    asyncio.run(main())


def test_cancelled_waiter_gives_back_its_tenant_and_global_places():
    async def main():
        limits = TenantAdmission(Admission(max_in_flight=1, max_queue=4), 1, 4)
        await limits.enter("a")
        waiter = asyncio.create_task(limits.enter("b"))  # waits for the global slot
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        limits.leave("a")
        assert limits.num_tenants == 0 and limits.admission.num_in_flight == 0 and limits.admission.num_queued == 0
    asyncio.run(main())


def test_load_fraction_counts_in_flight_and_queued():
    async def main():
        limits = TenantAdmission(Admission(max_in_flight=2, max_queue=2), 2, 2)
        await limits.enter("a")
        assert limits.load_fraction() == 0.25
        limits.leave("a")
    asyncio.run(main())


def test_limits_are_validated():
    with pytest.raises(ValueError):
        TenantAdmission(Admission(1, 1), 0, 1)
