"""A scheduler stream reset before its first message (CANCELLED that no Weft server chose)
is retried by the router like UNAVAILABLE: under a flood of 2,500 concurrent completions
on a live `weft up` mesh about 5 % got HTTP 503 "scheduler: CANCELLED: CANCELLED" before
any token, though nothing had been generated and a retry is invisible to the client. A
CANCELLED a Weft server chose (it carries an error origin) is still not retried."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from services.mesh.grpc_server import ERROR_ORIGIN_KEY
from services.router.errors import UpstreamError
from services.router.scheduler_client import SchedulerClient
from tests.unit.router.test_continuation import GreedyScheduler, MAX_TOKENS, SAFETY_S, reference, request
from weft.v1 import scheduler_pb2_grpc


class ResetFirst(GreedyScheduler):
    """The first ``num_resets`` calls end CANCELLED before any message with no error origin,
    which is what the client of a stream the transport reset sees; then greedy."""

    def __init__(self, num_resets: int, origin: bool = False) -> None:
        super().__init__()
        self.num_resets = num_resets
        self.origin = origin

    async def Generate(self, req, context):
        if self.num_resets > 0:
            self.num_resets -= 1
            self.requests.append(req)
            if self.origin:  # a status the server chose: it names the error's origin
                context.set_trailing_metadata(((ERROR_ORIGIN_KEY, "Chosen"),))
            await context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")
        async for resp in super().Generate(req, context):
            yield resp


async def _generate(servicer) -> tuple[list[int], int]:
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = SchedulerClient(f"127.0.0.1:{port}")
    try:
        ids = [t async for chunk in client.generate(request(), timeout_s=SAFETY_S) for t in chunk.token_ids]
        return ids, len(servicer.requests)
    finally:
        await client.close()
        await server.stop(0)


def test_a_stream_reset_before_its_first_message_is_retried_invisibly():
    ids, num_calls = asyncio.run(asyncio.wait_for(_generate(ResetFirst(num_resets=1)), SAFETY_S))
    assert ids == reference() and len(ids) == MAX_TOKENS
    assert num_calls == 2


def test_a_cancelled_the_server_chose_is_not_retried():
    with pytest.raises(UpstreamError, match="CANCELLED"):
        asyncio.run(asyncio.wait_for(_generate(ResetFirst(num_resets=1, origin=True)), SAFETY_S))
