"""What the executor keeps off a request's first-token path (issue 16, mesh overhead)."""
from __future__ import annotations

import asyncio

import pytest

from services.executor.app import promotes_before_prefill
from services.executor.config import ExecutorConfig
from services.executor.events import ExecutorEvents, Identity, KvChange
from services.executor.kv.block_pool import BlockRemoved, BlockStored


@pytest.mark.parametrize("prefix_caching, asked, expected", [
    (True, True, True),
    (True, False, False),
    (False, True, False),  # promoted blocks would never be found: no cachestore round trip per prompt
    (False, False, False),
])
def test_prompts_are_looked_up_in_the_cachestore_only_when_the_prefix_cache_can_use_them(
        tmp_path, prefix_caching, asked, expected):
    config = ExecutorConfig(model_dir=str(tmp_path), enable_prefix_caching=prefix_caching,
                            promote_before_prefill=asked, cachestore_address="127.0.0.1:1")
    assert promotes_before_prefill(config) is expected


# -- kv events wait for the step's streams -------------------------------------------------
def _events(delay_s: float, published: list) -> ExecutorEvents:
    async def publish(kind, item) -> bool:
        if isinstance(item, KvChange):
            published.append(item.event)
        return True

    identity = Identity(name="e0", address="127.0.0.1:1", model_id="m", block_size=16, max_num_seqs=4)
    # Heartbeat and load intervals far beyond the test: only kv events are published.
    return ExecutorEvents(publish, identity, heartbeat_interval_s=3600, load_interval_s=3600,
                          kv_publish_delay_s=delay_s)


def test_kv_events_are_not_published_in_the_loop_turns_that_hand_a_step_to_its_streams():
    published: list = []

    async def main():
        events = _events(3600.0, published)
        await events.start()
        try:
            events.on_kv_events([BlockStored((1, 2), None, "default")])
            for _ in range(20):  # pump -> servicer -> gRPC write take a few turns each
                await asyncio.sleep(0)
            return list(published)
        finally:
            await events.stop()

    assert asyncio.run(main()) == []


def test_kv_events_that_arrive_while_a_batch_waits_are_published_with_it_in_order():
    published: list = []
    first, second, third = BlockStored((1,), None, "default"), BlockStored((2,), 1, "default"), BlockRemoved((1,))

    async def main():
        events = _events(0.001, published)
        await events.start()
        try:
            events.on_kv_events([first])
            events.on_kv_events([second, third])
            deadline = asyncio.get_running_loop().time() + 10.0
            while len(published) < 3:
                assert asyncio.get_running_loop().time() < deadline, published
                await asyncio.sleep(0.001)
            return list(published)
        finally:
            await events.stop()

    assert asyncio.run(main()) == [first, second, third]


def test_a_negative_kv_publish_delay_is_refused():
    with pytest.raises(ValueError, match="kv_publish_delay_s"):
        _events(-1.0, [])
