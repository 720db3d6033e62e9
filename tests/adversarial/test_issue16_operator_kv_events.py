"""Issue 16, unlucky operator: kv events now wait a short coalescing delay before they are
published (services/executor/events.py). Events caught in that delay by a graceful stop
must still go out, once each and in order; an event that cannot be encoded or sent must
not end the publishing task (every later event of the executor's life would be lost
silently, the scheduler's view stale for good: no sequence gap ever tells it).
A kill -9 in the delay loses the events in hand by nature; the scheduler drops a
restarted executor's blocks on its new epoch (kv_index), so that case is not retested here.
"""
from __future__ import annotations

import asyncio

from services.executor.events import ExecutorEvents, Identity, KvChange
from services.executor.kv.block_pool import BlockRemoved, BlockStored

DEADLINE_TURNS = 2000  # loop turns to wait for a condition; past it the condition never came


def _events(delay_s: float, published: list, poison: object = None) -> ExecutorEvents:
    async def publish(kind, item) -> bool:
        if isinstance(item, KvChange):
            if item.event is poison:
                raise ValueError("cannot encode this event")
            published.append(item.event)
        return True

    identity = Identity(name="e0", address="127.0.0.1:1", model_id="m", block_size=16, max_num_seqs=4)
    return ExecutorEvents(publish, identity, heartbeat_interval_s=3600, load_interval_s=3600,
                          kv_publish_delay_s=delay_s)


async def _until(condition) -> None:
    for _ in range(DEADLINE_TURNS):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")


def test_a_graceful_stop_publishes_the_events_waiting_in_the_delay_once_each_in_order():
    published: list = []
    a, b, c = BlockStored((1,), None, "default"), BlockStored((2,), 1, "default"), BlockRemoved((1,))

    async def main():
        events = _events(3600.0, published)  # the delay never ends by itself
        await events.start()
        events.on_kv_events([a])
        await _until(lambda: events._kv_queue.empty() and not events._kv_queue._getters)  # taken: waiting
        events.on_kv_events([b, c])  # still queued behind the delay
        await _until(lambda: not events._kv_queue.empty())
        await events.stop()

    asyncio.run(main())
    assert published == [a, b, c]


def test_an_event_that_cannot_be_published_does_not_end_kv_publishing():
    published: list = []
    bad, good, later = BlockStored((7,), None, "default"), BlockStored((8,), None, "default"), BlockRemoved((8,))

    async def main():
        events = _events(0.0, published, poison=bad)
        await events.start()
        try:
            events.on_kv_events([bad, good])
            await _until(lambda: published == [good])
            events.on_kv_events([later])  # a later step's events still go out
            await _until(lambda: published == [good, later])
        finally:
            await events.stop()

    asyncio.run(main())
    assert published == [good, BlockRemoved((8,))]
