"""ChannelPool: the executors over gRPC, as the dispatcher's ExecutorPort
(dispatch/job.py): one channel per executor address, reused across requests; protobuf
built and read by convert.py.

A failed call reaches the dispatcher as ``ExecutorCallError`` (code name, details, and
whether the executor named its engine's death, policy/suspects.py). A token stream does
so only for the codes the path reacts to (UNAVAILABLE, INTERNAL, UNKNOWN); any other
status passes through as the executor's own error, so the client gets it unchanged
(an executor's INVALID_ARGUMENT reaches the client as INVALID_ARGUMENT).
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.mesh.grpc_server import channel_options
from services.mesh.mesh_auth import mesh_channel
from services.mesh.timeline import TRACEPARENT_KEY
from services.scheduler.api import convert
from services.scheduler.dispatch.job import Chunk, ExecutorCall, ExecutorCallError
from services.scheduler.policy.suspects import is_engine_failure
from services.scheduler.state.membership import ExecutorRecord
from weft.v1 import executor_pb2, executor_pb2_grpc

PROBE_TIMEOUT_S = 1.0  # a silent executor's health probe; a paused one times out and is dropped
_STREAM_FAILURES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)


def _call_error(exc: grpc.aio.AioRpcError) -> ExecutorCallError:
    return ExecutorCallError(exc.code().name, exc.details() or "", exc.code() == grpc.StatusCode.UNAVAILABLE,
                             is_engine_failure(exc))


class _GrpcStream:
    """One Executor.Generate call as a stream of chunks; ``done`` runs once when it ends."""

    def __init__(self, call, done=lambda: None) -> None:
        self._call = call
        self._done = done

    def cancel(self) -> None:
        self._call.cancel()

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        try:
            async for msg in self._call:
                yield convert.chunk_from_pb(msg, self._call)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _STREAM_FAILURES:
                raise _call_error(exc) from exc
            raise
        finally:
            done, self._done = self._done, lambda: None
            done()


class ChannelPool:
    def __init__(self, max_message_bytes: int) -> None:
        # Each channel its own subchannels: gRPC shares them process-wide by default, so a
        # fresh channel to a restarted executor would inherit the dead one's reconnect backoff.
        self._options = [*channel_options(max_message_bytes), ("grpc.use_local_subchannel_pool", 1)]
        self._stubs: dict[str, tuple[grpc.aio.Channel, executor_pb2_grpc.ExecutorStub]] = {}
        self._closing: set[asyncio.Task] = set()  # replaced channels being closed
        self._streams: dict[grpc.aio.Channel, int] = {}  # open Generate streams per channel
        self._retired: set[grpc.aio.Channel] = set()  # replaced, closed once their streams end

    async def serving(self, rec: ExecutorRecord) -> bool:
        """Whether ``rec`` answers grpc.health.v1 SERVING at its (verified) address, over
        the pooled channel. Never raises."""
        self.stub(rec.address)
        channel = self._stubs[rec.address][0]
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=PROBE_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def stub(self, address: str) -> executor_pb2_grpc.ExecutorStub:
        entry = self._stubs.get(address)
        if entry is not None and entry[0].get_state() is grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            # The executor was unreachable (killed, restarting) and gRPC is backing off its
            # reconnects, up to minutes: a call now fails at once even though the restarted
            # executor serves again. A fresh channel connects now. The old one may still carry
            # streams (a draining executor closed its listener, so reconnects fail, but its
            # connection finishes what it runs): it is closed once they end.
            self._retire(entry[0])
            entry = None
        if entry is None:
            channel = mesh_channel(address, options=self._options)
            entry = (channel, executor_pb2_grpc.ExecutorStub(channel))
            self._stubs[address] = entry
        return entry[1]

    def _retire(self, channel: grpc.aio.Channel) -> None:
        if self._streams.get(channel):
            self._retired.add(channel)
            return
        self._streams.pop(channel, None)
        self._retired.discard(channel)
        closing = asyncio.get_running_loop().create_task(channel.close())
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)

    def _stream_ended(self, channel: grpc.aio.Channel) -> None:
        self._streams[channel] -= 1
        if channel in self._retired and not self._streams[channel]:
            self._retire(channel)

    async def close(self) -> None:
        for channel in [c for c, _ in self._stubs.values()] + list(self._retired):
            await channel.close()
        self._stubs.clear()
        self._retired.clear()
        self._streams.clear()

    # -- ExecutorPort ---------------------------------------------------------------------
    def generate(self, address: str, call: ExecutorCall, timeout_s: float | None,
                 traceparent: str | None) -> _GrpcStream:
        stub = self.stub(address)
        channel = self._stubs[address][0]
        self._streams[channel] = self._streams.get(channel, 0) + 1
        return _GrpcStream(stub.Generate(
            convert.execute_request(call), timeout=timeout_s,
            metadata=((TRACEPARENT_KEY, traceparent),) if traceparent else None),
            done=lambda: self._stream_ended(channel))

    async def update_priorities(self, address: str, request_ids: Sequence[str],
                                priorities: Sequence[float]) -> None:
        await self._unary(self.stub(address).UpdatePriorities(executor_pb2.UpdatePrioritiesRequest(
            request_ids=request_ids, priorities=priorities), timeout=1.0))

    async def release_session(self, address: str, session_id: str, evict_block_hashes: Sequence[int]) -> None:
        await self._unary(self.stub(address).ReleaseSession(executor_pb2.ReleaseSessionRequest(
            session_id=session_id, evict_block_hashes=evict_block_hashes), timeout=2.0))

    async def demote_blocks(self, address: str, token_ids: Sequence[int], tenant: str, priority: float,
                            expected_pause_ms: int) -> None:
        await self._unary(self.stub(address).DemoteBlocks(executor_pb2.DemoteBlocksRequest(
            token_ids=token_ids, tenant_salt=tenant, priority=priority, expected_pause_ms=expected_pause_ms,
            evict_first=True), timeout=10.0))

    async def promote_blocks(self, address: str, token_ids: Sequence[int], tenant: str) -> None:
        # force: the pause policy already priced the round trip when it chose demote.
        await self._unary(self.stub(address).PromoteBlocks(executor_pb2.PromoteBlocksRequest(
            token_ids=token_ids, tenant_salt=tenant, partition=tenant, force=True), timeout=10.0))

    @staticmethod
    async def _unary(call) -> None:
        try:
            await call
        except grpc.aio.AioRpcError as exc:
            raise _call_error(exc) from exc
