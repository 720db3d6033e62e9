"""The router's scheduler client hands a reply's last chunk on before it reads the call's
trailers (the scheduler's and executor's spans): a one-chunk reply's first token does not
wait for them, and the timeline still gets them before the stream is closed."""
from __future__ import annotations

import asyncio

import grpc

from services.mesh.timeline import CURRENT_TRACE, Span, Trace, spans_metadata
from services.router.scheduler_client import SchedulerClient
from services.router.schema import Sampling, Session, TokenRequest
from weft.v1 import common_pb2, scheduler_pb2

DOWNSTREAM = Span("t" * 32, "s" * 16, "r" * 16, "scheduler.request", "scheduler", 1, 2)


class OneChunkCall:
    """A finished one-message call whose trailers arrive only when ``trailers`` is set."""

    def __init__(self) -> None:
        self.trailers = asyncio.Event()
        self.num_reads = 0
        self.cancelled = False

    async def read(self):
        self.num_reads += 1
        if self.num_reads > 1:
            return grpc.aio.EOF
        return scheduler_pb2.ScheduleResponse(request_id="r", token_ids_delta=[7], executor="e0",
                                              finish_reason=common_pb2.FINISH_REASON_LENGTH)

    async def trailing_metadata(self):
        await self.trailers.wait()
        return spans_metadata([DOWNSTREAM])

    def cancel(self) -> None:
        self.cancelled = True


class Stub:
    def __init__(self, call: OneChunkCall) -> None:
        self.call = call

    def Generate(self, message, timeout=None, metadata=None):  # noqa: N802 (the gRPC stub's name)
        return self.call


def _request() -> TokenRequest:
    return TokenRequest(request_id="r", model="m", prompt_token_ids=(1, 2, 3), tenant="t",
                        sampling=Sampling(max_tokens=1), session=Session())


def test_a_one_chunk_reply_reaches_the_caller_before_its_trailers_and_the_trace_still_gets_them():
    async def main():
        call = OneChunkCall()
        client = SchedulerClient("127.0.0.1:1")
        client._stub = Stub(call)
        trace = Trace("r", "router")
        CURRENT_TRACE.set(trace)
        try:
            chunks = client.generate(_request(), timeout_s=10)
            # The old client awaited the trailers before handing the chunk on: this wait ran out.
            chunk = await asyncio.wait_for(anext(chunks), 5)
            assert chunk.token_ids == (7,) and chunk.finish_reason == "length"
            assert trace.downstream == [] and not call.cancelled
            call.trailers.set()  # they follow the last message
            await asyncio.wait_for(chunks.aclose(), 5)
            assert trace.downstream == [DOWNSTREAM]  # read as the stream closed, before the router finishes it
            assert call.cancelled
        finally:
            await client.close()

    asyncio.run(main())


def test_trailers_that_never_come_do_not_hold_the_close_beyond_their_bound(monkeypatch):
    from services.router import scheduler_client
    from services.mesh import timeline

    async def bounded(call, timeout_s: float = 1.0):
        return await timeline.downstream_spans(call, timeout_s=0.05)

    monkeypatch.setattr(scheduler_client, "downstream_spans", bounded)

    async def main():
        call = OneChunkCall()  # trailers never set
        client = SchedulerClient("127.0.0.1:1")
        client._stub = Stub(call)
        trace = Trace("r", "router")
        CURRENT_TRACE.set(trace)
        try:
            chunks = client.generate(_request(), timeout_s=10)
            await asyncio.wait_for(anext(chunks), 5)
            await asyncio.wait_for(chunks.aclose(), 5)
            assert trace.downstream == [] and call.cancelled
        finally:
            await client.close()

    asyncio.run(main())
