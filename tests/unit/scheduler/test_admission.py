import asyncio

import pytest

from services.scheduler.policy.admission import Admission
from services.scheduler.errors import OverloadedError


def run(coro):
    return asyncio.run(coro)


def test_admits_up_to_max_in_flight_then_queues_then_refuses_with_retry_hint():
    async def scenario():
        adm = Admission(max_in_flight=2, max_queue=1, retry_after_ms=100)
        await adm.enter()
        await adm.enter()
        waiter = asyncio.create_task(adm.enter())
        await asyncio.sleep(0)  # let it queue
        assert adm.num_queued == 1 and not waiter.done()
        with pytest.raises(OverloadedError) as err:
            await adm.enter()
        assert err.value.retry_after_ms >= 100
        adm.leave()  # hands the slot to the waiter
        await asyncio.wait_for(waiter, 1)
        assert adm.num_in_flight == 2 and adm.num_queued == 0
        adm.leave()
        adm.leave()
        assert adm.num_in_flight == 0

    run(scenario())


def test_cancelled_waiter_leaves_the_queue():
    async def scenario():
        adm = Admission(max_in_flight=1, max_queue=5)
        await adm.enter()
        waiter = asyncio.create_task(adm.enter())
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert adm.num_queued == 0
        adm.leave()
        assert adm.num_in_flight == 0

    run(scenario())


def test_slot_handed_to_a_cancelled_waiter_is_passed_on_not_leaked():
    async def scenario():
        adm = Admission(max_in_flight=1, max_queue=5)
        await adm.enter()
        first = asyncio.create_task(adm.enter())
        second = asyncio.create_task(adm.enter())
        await asyncio.sleep(0)
        adm.leave()  # slot → first
        first.cancel()  # cancelled before it ran: the slot goes on to second
        with pytest.raises(asyncio.CancelledError):
            await first
        await asyncio.wait_for(second, 1)
        assert adm.num_in_flight == 1
        adm.leave()
        assert adm.num_in_flight == 0

    run(scenario())


def test_slot_context_manager_releases_on_error():
    async def scenario():
        adm = Admission(max_in_flight=1, max_queue=0)
        with pytest.raises(RuntimeError):
            async with adm.slot():
                raise RuntimeError("boom")
        assert adm.num_in_flight == 0
        async with adm.slot():
            assert not adm.can_enter()

    run(scenario())


def test_leave_without_enter_is_misuse():
    with pytest.raises(ValueError):
        Admission(1, 0).leave()
