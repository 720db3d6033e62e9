"""The router's client of ``weft.v1.CacheStore`` (semantic cache, /v1/embeddings): like
``scheduler_client.py``, an outbound wire boundary, the only other router module that
touches generated protobuf types. Lookups are bounded by a short deadline; any failure
is reported as a miss by the caller, never as a failed request."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


from services.mesh.mesh_auth import mesh_channel

from weft.v1 import cachestore_pb2, cachestore_pb2_grpc


@dataclass(frozen=True)
class Embeddings:
    """What ``CacheStore.Embed`` answered: one L2-normalised vector per text, in order."""

    vectors: list[list[float]]
    num_tokens: list[int]  # word pieces the model read of each text
    model: str


class CacheStoreClient:
    def __init__(self, address: str, timeout_s: float = 1.0, store_timeout_s: float = 30.0) -> None:
        self.address = address
        self.timeout_s = timeout_s  # lookups: on the request's path
        self.store_timeout_s = store_timeout_s  # stores: in the background (the first one may load the model)
        self._channel = mesh_channel(address)
        self._stub = cachestore_pb2_grpc.CacheStoreStub(self._channel)

    async def lookup_response(self, tenant: str, scope: str, text: str) -> tuple[int, ...] | None:
        """Cached output tokens of a similar prompt, or None. Raises grpc errors."""
        reply = await self._stub.SemanticLookup(cachestore_pb2.SemanticLookupRequest(
            tenant=tenant, kind=cachestore_pb2.SEMANTIC_KIND_RESPONSE, scope=scope, text=text),
            timeout=self.timeout_s)
        return tuple(reply.token_ids) if reply.hit else None

    async def store_response(self, tenant: str, scope: str, text: str, token_ids: Sequence[int]) -> None:
        await self._stub.SemanticStore(cachestore_pb2.SemanticStoreRequest(
            tenant=tenant, kind=cachestore_pb2.SEMANTIC_KIND_RESPONSE, scope=scope, text=text,
            token_ids=list(token_ids)), timeout=self.store_timeout_s)

    async def lookup_session(self, tenant: str, scope: str, text: str) -> tuple[int, ...] | None:
        """Prompt tokens of a known session whose first turn resembles ``text``, or None."""
        reply = await self._stub.SemanticLookup(cachestore_pb2.SemanticLookupRequest(
            tenant=tenant, kind=cachestore_pb2.SEMANTIC_KIND_SESSION_PREFIX, scope=scope, text=text),
            timeout=self.timeout_s)
        return tuple(reply.token_ids) if reply.hit else None

    async def store_session(self, tenant: str, scope: str, text: str, token_ids: Sequence[int]) -> None:
        await self._stub.SemanticStore(cachestore_pb2.SemanticStoreRequest(
            tenant=tenant, kind=cachestore_pb2.SEMANTIC_KIND_SESSION_PREFIX, scope=scope, text=text,
            token_ids=list(token_ids)), timeout=self.store_timeout_s)

    async def prefetch(self, tenant: str, token_ids: Sequence[int]) -> int:
        """Warm the prefix's blocks in the store; returns how many it holds."""
        reply = await self._stub.PrefetchBlocks(cachestore_pb2.PrefetchBlocksRequest(
            tenant=tenant, token_ids=list(token_ids)), timeout=self.timeout_s)
        return reply.num_found_blocks

    async def embed(self, texts: Sequence[str], timeout_s: float) -> Embeddings:
        """Embeddings of ``texts`` (the cachestore's model). Raises grpc errors."""
        reply = await self._stub.Embed(cachestore_pb2.EmbedRequest(texts=list(texts)), timeout=timeout_s)
        return Embeddings([list(e.values) for e in reply.embeddings], list(reply.num_tokens), reply.model)

    async def close(self) -> None:
        await self._channel.close()
