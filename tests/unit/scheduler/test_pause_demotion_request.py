"""The scheduler's pause demotion asks the executor to keep its copies, first to go.

``evict_local`` would make every demoted hop load its context back (or recompute it) on
resume even when the pool never needed the room; ``evict_first`` leaves that to the pool."""
from __future__ import annotations

import asyncio

from services.scheduler.api.executor_port import ChannelPool


class _Stub:
    def __init__(self) -> None:
        self.requests = []

    def DemoteBlocks(self, request, timeout=None):  # noqa: N802 - the gRPC method's name
        self.requests.append(request)

        async def reply():
            return None
        return reply()


def test_the_pause_demotion_keeps_the_local_copies_first_in_line():
    pool = ChannelPool(1 << 20)
    stub = _Stub()
    pool.stub = lambda address: stub
    asyncio.run(pool.demote_blocks("127.0.0.1:1", [1, 2, 3], "tenant-a", 0.5, 800))
    (request,) = stub.requests
    assert request.evict_first and not request.evict_local
    assert list(request.token_ids) == [1, 2, 3] and request.expected_pause_ms == 800
