"""Async client of the CacheStore for the executor: chunked block streams, bounded retries.

Only UNAVAILABLE / RESOURCE_EXHAUSTED are retried (``services.mesh.retry``); a retried
PutBlocks re-sends the whole batch, which is safe because the store skips blocks it
already holds. Misses are values, never errors: ``get_blocks`` returns the leading
run of blocks it received and stops at the first miss (a chain cannot skip a block).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

from services.executor.tiers.kv_transfer import KvPayload, checksum
from services.mesh.mesh_auth import mesh_channel
from services.mesh.grpc_server import channel_options
from services.mesh.retry import rpc_retrying
from weft.v1 import cachestore_pb2, cachestore_pb2_grpc, events_pb2

_TIER_NAMES = {events_pb2.TIER_SLEEPING: "sleeping", events_pb2.TIER_ARCHIVED: "archived"}


class TierClient:
    def __init__(self, address: str, chunk_bytes: int = 1 << 20, timeout_s: float = 30.0,
                 max_message_bytes: int = 64 << 20, model_id: str = "", block_size: int = 0) -> None:
        self.address = address
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.model_id = model_id
        self.block_size = block_size
        self._channel = mesh_channel(address, options=channel_options(max_message_bytes))
        self._stub = cachestore_pb2_grpc.CacheStoreStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def contains(self, block_hashes: Sequence[int]) -> list[str | None]:
        """Per hash: "sleeping", "archived" or None (absent)."""
        if not block_hashes:
            return []
        async for attempt in rpc_retrying():
            with attempt:
                reply = await self._stub.Contains(
                    cachestore_pb2.ContainsRequest(block_hashes=list(block_hashes)), timeout=self.timeout_s)
        return [_TIER_NAMES.get(t) for t in reply.tiers]

    def _chunks(self, payloads: Sequence[KvPayload], priority: float,
                expected_pause_ms: int) -> Iterator[cachestore_pb2.PutBlocksChunk]:
        for p in payloads:
            yield cachestore_pb2.PutBlocksChunk(header=cachestore_pb2.BlockHeader(
                block_hash=p.block_hash, dtype=p.dtype, shape=p.shape, size_bytes=p.size_bytes,
                checksum=checksum(p.data), model_id=self.model_id, block_size=self.block_size,
                priority=priority, expected_pause_ms=expected_pause_ms))
            view = memoryview(p.data)
            for start in range(0, len(view), self.chunk_bytes):
                yield cachestore_pb2.PutBlocksChunk(data=bytes(view[start:start + self.chunk_bytes]))

    async def put_blocks(self, payloads: Sequence[KvPayload], priority: float = 0.0,
                         expected_pause_ms: int = 0) -> cachestore_pb2.PutBlocksResponse:
        """Store ``payloads``; raises the gRPC error (RESOURCE_EXHAUSTED: no tier has room)."""
        async for attempt in rpc_retrying():
            with attempt:
                return await self._stub.PutBlocks(
                    self._chunks(payloads, priority, expected_pause_ms), timeout=self.timeout_s)

    async def get_blocks(self, block_hashes: Sequence[int]) -> list[KvPayload]:
        """The leading run of ``block_hashes`` the store could serve, in order."""
        out: list[KvPayload] = []
        async for attempt in rpc_retrying():
            with attempt:
                out = await self._get(block_hashes)
        return out

    async def _get(self, block_hashes: Sequence[int]) -> list[KvPayload]:
        out: list[KvPayload] = []
        header, buf = None, bytearray()

        def finish() -> bool:
            if header is None:
                return True
            data = bytes(buf)
            if len(data) != header.size_bytes or checksum(data) != header.checksum:
                return False  # damaged on the way: treat as the first miss
            out.append(KvPayload(header.block_hash, header.dtype, tuple(header.shape), data))
            return True

        call = self._stub.GetBlocks(cachestore_pb2.GetBlocksRequest(
            block_hashes=list(block_hashes), max_chunk_bytes=self.chunk_bytes), timeout=self.timeout_s)
        try:
            async for chunk in call:
                which = chunk.WhichOneof("chunk")
                if which == "header":
                    if not finish():
                        return out
                    header, buf = chunk.header, bytearray()
                elif which == "data":
                    buf += chunk.data
                else:  # a miss ends the usable run
                    finish()
                    return out
            finish()
            return out
        finally:
            call.cancel()
