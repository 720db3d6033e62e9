"""The router → scheduler hop: retried (tenacity, bounded) only on retryable codes and
only before the first chunk; the retry hint reaches the client as OverloadedError."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from services.router.errors import InvalidRequestError, OverloadedError, UpstreamUnavailable
from services.router.scheduler_client import MAX_ATTEMPTS, SchedulerClient
from services.router.schema import Sampling, Session, TokenRequest
from weft.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc


class FlakyScheduler(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, failures: list[grpc.StatusCode], fail_mid_stream: bool = False) -> None:
        self.failures = list(failures)
        self.fail_mid_stream = fail_mid_stream
        self.num_calls = 0

    async def Generate(self, request, context):
        self.num_calls += 1
        if self.failures:
            code = self.failures.pop(0)
            context.set_trailing_metadata((("retry-after-ms", "20"),))
            await context.abort(code, "field_x: nope" if code == grpc.StatusCode.INVALID_ARGUMENT else "busy")
        yield scheduler_pb2.ScheduleResponse(request_id=request.request_id, token_ids_delta=[1], executor="e",
                                             degradation_rung=common_pb2.DEGRADATION_RUNG_NONE)
        if self.fail_mid_stream:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "lost")
        yield scheduler_pb2.ScheduleResponse(request_id=request.request_id, token_ids_delta=[2],
                                             finish_reason=common_pb2.FINISH_REASON_LENGTH, num_migrations=1)


def _request() -> TokenRequest:
    return TokenRequest(request_id="r1", model="m", prompt_token_ids=(1, 2), tenant="t",
                        sampling=Sampling(max_tokens=2), session=Session())


async def _collect(servicer: FlakyScheduler):
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = SchedulerClient(f"127.0.0.1:{port}")
    try:
        return [c async for c in client.generate(_request(), timeout_s=10)]
    finally:
        await client.close()
        await server.stop(0)


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED])
def test_retryable_failures_before_the_first_chunk_are_retried_invisibly(code):
    servicer = FlakyScheduler([code] * (MAX_ATTEMPTS - 1))
    chunks = asyncio.run(_collect(servicer))
    assert [c.token_ids for c in chunks] == [(1,), (2,)] and servicer.num_calls == MAX_ATTEMPTS
    assert chunks[0].degradation_rung == "none" and chunks[-1].num_migrations == 1


def test_retries_are_bounded_and_overload_keeps_its_retry_hint():
    servicer = FlakyScheduler([grpc.StatusCode.RESOURCE_EXHAUSTED] * 10)
    with pytest.raises(OverloadedError) as info:
        asyncio.run(_collect(servicer))
    assert servicer.num_calls == MAX_ATTEMPTS and info.value.retry_after_ms == 20


def test_invalid_argument_is_never_retried():
    servicer = FlakyScheduler([grpc.StatusCode.INVALID_ARGUMENT])
    with pytest.raises(InvalidRequestError):
        asyncio.run(_collect(servicer))
    assert servicer.num_calls == 1


def test_failure_after_the_first_chunk_is_not_retried():
    servicer = FlakyScheduler([], fail_mid_stream=True)
    with pytest.raises(UpstreamUnavailable):
        asyncio.run(_collect(servicer))
    assert servicer.num_calls == 1


def test_a_scheduler_that_is_down_is_waited_for_beyond_the_attempt_bound_until_it_is_back():
    """kill -9 of the scheduler: its supervisor brings it back on the same port within a
    second or two. A new request arriving meanwhile finds no listener; it is retried past
    MAX_ATTEMPTS (up to SCHEDULER_OUTAGE_S) and served once the scheduler listens again,
    where it used to get 503 'failed to connect to all addresses'."""
    from services.mesh.nats_server import free_port

    async def main():
        port = free_port()
        client = SchedulerClient(f"127.0.0.1:{port}")
        attempts = 0
        came_back = asyncio.Event()
        generate = client._stub.Generate

        def counting(*args, **kwargs):
            nonlocal attempts
            attempts += 1
            if attempts == MAX_ATTEMPTS + 1:  # the old bound is spent: the scheduler now returns
                came_back.set()
            return generate(*args, **kwargs)

        client._stub.Generate = counting
        server = grpc.aio.server()
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(FlakyScheduler([]), server)

        async def restart_later():
            await came_back.wait()
            server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()

        restarter = asyncio.create_task(restart_later())
        try:
            return [c async for c in client.generate(_request(), timeout_s=30)], attempts
        finally:
            restarter.cancel()
            await client.close()
            await server.stop(0)

    chunks, attempts = asyncio.run(main())
    assert [c.token_ids for c in chunks] == [(1,), (2,)] and attempts > MAX_ATTEMPTS


def test_a_scheduler_back_and_connected_by_the_time_the_retry_is_decided_still_serves_the_request():
    """The race CI hit: the attempt past MAX_ATTEMPTS is refused, then the scheduler
    listens and the channel reconnects (READY) before tenacity decides whether to stop.
    The refusal is still a refusal ("failed to connect"), so the request is retried and
    served, not answered 503."""
    from services.mesh.nats_server import free_port

    async def main():
        port = free_port()
        client = SchedulerClient(f"127.0.0.1:{port}")
        server = grpc.aio.server()
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(FlakyScheduler([]), server)
        attempts = 0
        generate = client._stub.Generate

        class RefusedThenBack:
            """The refused call; its failure surfaces only once the channel is READY again."""

            def __init__(self, call) -> None:
                self.call = call

            def cancel(self) -> bool:
                return self.call.cancel()

            async def read(self):
                try:
                    return await self.call.read()
                except grpc.aio.AioRpcError:
                    server.add_insecure_port(f"127.0.0.1:{port}")
                    await server.start()
                    state = client._channel.get_state(try_to_connect=True)
                    while state != grpc.ChannelConnectivity.READY:
                        await client._channel.wait_for_state_change(state)
                        state = client._channel.get_state(try_to_connect=True)
                    raise

        def counting(*args, **kwargs):
            nonlocal attempts
            attempts += 1
            call = generate(*args, **kwargs)
            return RefusedThenBack(call) if attempts == MAX_ATTEMPTS + 1 else call

        client._stub.Generate = counting
        try:
            return [c async for c in client.generate(_request(), timeout_s=30)], attempts
        finally:
            await client.close()
            await server.stop(0)

    chunks, attempts = asyncio.run(main())
    assert [c.token_ids for c in chunks] == [(1,), (2,)] and attempts == MAX_ATTEMPTS + 2
