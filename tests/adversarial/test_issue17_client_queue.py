"""Issue 17, hostile client against the one scored queue: a tenant flooding it cannot keep
another tenant waiting behind its backlog, a waiter cancelled while queued holds no slot and
no place, and a full queue refuses at once with a retry hint that grows with the backlog."""
from __future__ import annotations

import asyncio

import pytest

from services.scheduler.errors import OverloadedError
from services.scheduler.policy.admission import Admission


async def settle() -> None:
    """Let every task that can run, run (the queue hands slots out synchronously)."""
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_flood_cannot_starve_another_tenant_and_a_cancelled_waiter_holds_nothing():
    async def main():
        a = Admission(2, 16, max_in_flight_per_tenant=2, max_queue_per_tenant=8)
        served: list[str] = []

        async def request(tenant: str, name: str, score: float) -> None:
            await a.enter(lambda now: score, tenant)
            served.append(name)
        flood = [asyncio.ensure_future(request("flood", f"f{i}", -100.0 + i)) for i in range(10)]  # best scores
        await settle()
        cancelled = asyncio.ensure_future(request("polite", "cancelled", 0.0))
        polite = asyncio.ensure_future(request("polite", "p", 0.0))
        await settle()
        over = [asyncio.ensure_future(request("flood", "over", 0.0))]
        await settle()
        cancelled.cancel()
        await settle()
        queued_after_cancel = a.num_queued
        a.leave("flood")  # one flood request finishes: the slot goes to the polite tenant
        await settle()
        return served, queued_after_cancel, over[0].exception(), polite.done(), a.num_in_flight

    served, queued, over, polite_done, in_flight = asyncio.run(main())
    assert served[:2] == ["f0", "f1"] and served[2] == "p"
    assert "cancelled" not in served and queued == 9  # 8 flood waiters and p; the cancelled one is gone
    assert isinstance(over, OverloadedError) and over.retry_after_ms >= 200
    assert polite_done and in_flight == 2


def test_a_full_queue_refuses_at_once_with_a_retry_hint_that_grows_with_the_backlog():
    async def main():
        a = Admission(1, 2, retry_after_ms=100)
        await a.enter(tenant="x")
        waiters = [asyncio.ensure_future(a.enter(tenant=t)) for t in ("y", "z")]
        await settle()
        with pytest.raises(OverloadedError) as full:
            await a.enter(tenant="w")
        for w in waiters:
            w.cancel()
        await settle()
        return full.value.retry_after_ms, a.num_queued, a.num_in_flight

    hint, queued, in_flight = asyncio.run(main())
    assert hint == 300  # (2 queued + 1 in flight) / 1 slot x 100 ms
    assert (queued, in_flight) == (0, 1)
