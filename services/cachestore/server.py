"""The CacheStore gRPC servicer: the only place cachestore protos meet the tiers.

PutBlocks stream grammar (validated as it arrives)::

    (header data*)*      each block: one header, then data chunks summing to size_bytes

A malformed stream fails with INVALID_ARGUMENT naming the field; blocks completed
before the error stay stored (each block is stored on its own, not as a batch).
Disk I/O runs in worker threads so a large block never stalls the event loop.
"""
from __future__ import annotations

import asyncio

import structlog

from services.cachestore.blocks import DTYPE_BYTES, Block, BlockMeta, checksum
from services.cachestore.errors import InvalidBlockError, InvalidQueryError, StoreFullError
from services.cachestore.semantic import SemanticKind
from services.cachestore.semantic_service import SemanticService
from services.cachestore.tiers import Tier, TieredStore
from services.shared.block_hash import extra_keys_for, hash_block_chain
from services.mesh import metrics
from weft.v1 import cachestore_pb2, cachestore_pb2_grpc, events_pb2

log = structlog.get_logger(__name__)

_TIERS = {Tier.SLEEPING: events_pb2.TIER_SLEEPING, Tier.ARCHIVED: events_pb2.TIER_ARCHIVED}

BLOCKS_STORED = metrics.counter("weft_cachestore_blocks_stored_total", "Blocks written by PutBlocks.")
BYTES_STORED = metrics.counter("weft_cachestore_bytes_stored_total", "Payload bytes written by PutBlocks.")
LOOKUPS = metrics.counter("weft_cachestore_lookups_total", "GetBlocks lookups by result.", ["result"])
TIER_BYTES = metrics.gauge("weft_cachestore_tier_bytes", "Payload bytes held per tier.", ["tier"])
TIER_BLOCKS = metrics.gauge("weft_cachestore_tier_blocks", "Blocks held per tier.", ["tier"])
TIER_HIT_RATIO = metrics.gauge("weft_cachestore_tier_hit_ratio", "Hits / lookups per tier since start.", ["tier"])
DEMOTIONS = metrics.counter("weft_kv_demotions_total",
                            "KV blocks moved down a tier (stored into the cachestore, or host RAM to disk).",
                            ["from_tier", "to_tier"])
PROMOTIONS = metrics.counter("weft_kv_promotions_total",
                             "KV blocks moved up a tier (served by the cachestore back towards an executor).",
                             ["from_tier", "to_tier"])
SEMANTIC_LOOKUPS = metrics.counter("weft_cachestore_semantic_lookups_total", "Semantic lookups by kind and result.",
                                   ["kind", "result"])
_BATCH_BYTES = 8 << 20  # GetBlocks reads this much per worker-thread hop

_SEMANTIC_KINDS = {cachestore_pb2.SEMANTIC_KIND_RESPONSE: SemanticKind.RESPONSE,
                   cachestore_pb2.SEMANTIC_KIND_SESSION_PREFIX: SemanticKind.SESSION_PREFIX}


def export_tier_gauges(store: TieredStore) -> None:
    """Set the per-tier gauges from the store's counters (cheap; called after changes)."""
    for name, tier in (("sleeping", store.host), ("archived", store.disk)):
        if tier is None:
            continue
        TIER_BYTES.labels(name).set(tier.used_bytes)
        TIER_BLOCKS.labels(name).set(len(tier))
        lookups = tier.num_hits + tier.num_misses
        TIER_HIT_RATIO.labels(name).set(tier.num_hits / lookups if lookups else 0.0)


def meta_from_header(h: cachestore_pb2.BlockHeader, max_block_bytes: int) -> BlockMeta:
    """Validate a header; raises InvalidBlockError naming the field."""
    if h.dtype not in DTYPE_BYTES:
        raise InvalidBlockError("header.dtype", f"{h.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    if not h.shape or any(d == 0 for d in h.shape):
        raise InvalidBlockError("header.shape", f"must be non-empty with positive dimensions, got {list(h.shape)}")
    if h.size_bytes == 0 or h.size_bytes > max_block_bytes:
        raise InvalidBlockError("header.size_bytes", f"must be in [1, {max_block_bytes}], got {h.size_bytes}")
    if h.priority != h.priority:  # NaN
        raise InvalidBlockError("header.priority", "must be a number")
    meta = BlockMeta(h.block_hash, h.dtype, tuple(h.shape), h.size_bytes, h.checksum, h.model_id, h.block_size,
                     h.priority, h.expected_pause_ms)
    if meta.expected_size_bytes != h.size_bytes:
        raise InvalidBlockError(
            "header.size_bytes", f"{h.size_bytes} disagrees with shape {list(h.shape)} of {h.dtype} "
            f"({meta.expected_size_bytes} bytes)")
    return meta


def header_from_meta(m: BlockMeta) -> cachestore_pb2.BlockHeader:
    return cachestore_pb2.BlockHeader(
        block_hash=m.block_hash, dtype=m.dtype, shape=m.shape, size_bytes=m.size_bytes,
        checksum=m.checksum, model_id=m.model_id, block_size=m.block_size,
        priority=m.priority, expected_pause_ms=m.expected_pause_ms,
    )


class CacheStoreServicer(cachestore_pb2_grpc.CacheStoreServicer):
    def __init__(self, store: TieredStore, max_block_bytes: int, chunk_bytes: int,
                 semantic: SemanticService | None = None) -> None:
        self.store = store
        self.max_block_bytes = max_block_bytes
        self.chunk_bytes = chunk_bytes
        self.semantic = semantic or SemanticService()

    async def PutBlocks(self, request_iterator, context) -> cachestore_pb2.PutBlocksResponse:
        reply = cachestore_pb2.PutBlocksResponse()
        meta: BlockMeta | None = None
        buf = bytearray()
        async for chunk in request_iterator:
            which = chunk.WhichOneof("chunk")
            if which == "header":
                if meta is not None:
                    await self._finish_block(meta, buf, reply)
                meta, buf = meta_from_header(chunk.header, self.max_block_bytes), bytearray()
            elif which == "data":
                if meta is None:
                    raise InvalidBlockError("data", "data chunk before any header")
                if len(buf) + len(chunk.data) > meta.size_bytes:
                    raise InvalidBlockError(
                        "data", f"block {meta.block_hash:#x} has more than header.size_bytes={meta.size_bytes} bytes")
                buf += chunk.data
            else:
                raise InvalidBlockError("chunk", "empty chunk: set header or data")
        if meta is not None:
            await self._finish_block(meta, buf, reply)
        return reply

    async def _finish_block(self, meta: BlockMeta, buf: bytearray, reply) -> None:
        if len(buf) != meta.size_bytes:
            raise InvalidBlockError(
                "data", f"block {meta.block_hash:#x} ended after {len(buf)} of {meta.size_bytes} bytes")
        payload = bytes(buf)
        if checksum(payload) != meta.checksum:
            raise InvalidBlockError("header.checksum", f"block {meta.block_hash:#x}: payload checksum mismatch")
        result = await asyncio.to_thread(self.store.put, Block(meta, payload))
        if not result.stored:
            raise StoreFullError(f"block {meta.block_hash:#x} of {meta.size_bytes} bytes fits no tier")
        if result.already_present:
            reply.num_already_present += 1
        else:
            reply.num_stored += 1
            reply.stored_bytes += meta.size_bytes
            BLOCKS_STORED.inc()
            BYTES_STORED.inc(meta.size_bytes)
            DEMOTIONS.labels("active", "sleeping").inc()

    async def GetBlocks(self, request: cachestore_pb2.GetBlocksRequest, context):
        chunk_bytes = min(request.max_chunk_bytes or self.chunk_bytes, self.chunk_bytes)
        hashes = list(request.block_hashes)
        # Blocks are read in batches, one worker-thread hop per batch (a hop per block
        # cost more than the bytes on loopback); a batch holds at most ~_BATCH_BYTES.
        i = 0
        while i < len(hashes):
            batch = await asyncio.to_thread(self._read_batch, hashes, i)
            for tier, block_hash, block in batch:
                i += 1
                if block is None:
                    LOOKUPS.labels("miss").inc()
                    yield cachestore_pb2.GetBlocksChunk(missing_block_hash=block_hash)
                    continue
                LOOKUPS.labels("hit").inc()
                PROMOTIONS.labels(tier.value if tier else "sleeping", "active").inc()
                yield cachestore_pb2.GetBlocksChunk(header=header_from_meta(block.meta))
                view = memoryview(block.payload)
                for start in range(0, len(view), chunk_bytes):
                    yield cachestore_pb2.GetBlocksChunk(data=bytes(view[start:start + chunk_bytes]))

    def _read_batch(self, hashes: list[int], start: int) -> list[tuple[Tier | None, int, Block | None]]:
        out, nbytes = [], 0
        for h in hashes[start:]:
            tier = self.store.tier_of(h)
            block = self.store.get(h)
            out.append((tier, h, block))
            nbytes += block.size_bytes if block is not None else 0
            if nbytes >= _BATCH_BYTES:
                break
        return out

    async def Contains(self, request: cachestore_pb2.ContainsRequest, context) -> cachestore_pb2.ContainsResponse:
        hashes = list(request.block_hashes)
        tiers = await asyncio.to_thread(lambda: [self.store.tier_of(h) for h in hashes])  # the lock may wait on disk I/O
        export_tier_gauges(self.store)
        return cachestore_pb2.ContainsResponse(
            tiers=[_TIERS[t] if t is not None else events_pb2.TIER_UNSPECIFIED for t in tiers])

    async def Stats(self, request, context) -> cachestore_pb2.CacheStatsResponse:
        host, disk = self.store.host, self.store.disk
        out = cachestore_pb2.CacheStatsResponse(num_corrupt_blocks=disk.num_corrupt if disk else 0)
        out.tiers.add(tier=events_pb2.TIER_SLEEPING, num_blocks=len(host), used_bytes=host.used_bytes,
                      capacity_bytes=host.capacity_bytes, num_hits=host.num_hits, num_misses=host.num_misses,
                      num_evictions=host.num_evictions)
        if disk is not None:
            out.tiers.add(tier=events_pb2.TIER_ARCHIVED, num_blocks=len(disk), used_bytes=disk.used_bytes,
                          capacity_bytes=disk.capacity_bytes, num_hits=disk.num_hits, num_misses=disk.num_misses,
                          num_evictions=disk.num_evictions)
        return out

    # -- semantic index ---------------------------------------------------------------
    async def Embed(self, request: cachestore_pb2.EmbedRequest, context) -> cachestore_pb2.EmbedResponse:
        vectors, num_tokens = await self.semantic.embed_counted(list(request.texts))
        return cachestore_pb2.EmbedResponse(
            embeddings=[cachestore_pb2.Embedding(values=v.tolist()) for v in vectors], dim=self.semantic.dim,
            num_tokens=num_tokens, model=self.semantic.model_name)

    async def Similarity(self, request: cachestore_pb2.SimilarityRequest, context) -> cachestore_pb2.SimilarityResponse:
        sim = await self.semantic.similarity(request.text_a, request.text_b)
        t = self.semantic.index.threshold
        return cachestore_pb2.SimilarityResponse(similarity=sim, similar=sim >= t, threshold=t)

    async def SemanticLookup(self, request: cachestore_pb2.SemanticLookupRequest,
                             context) -> cachestore_pb2.SemanticLookupResponse:
        kind = _semantic_kind(request.kind)
        best = await self.semantic.best(request.tenant, kind, request.scope, request.text)
        t = self.semantic.index.threshold
        hit = best is not None and best.similarity >= t
        SEMANTIC_LOOKUPS.labels(kind.value, "hit" if hit else "miss").inc()
        return cachestore_pb2.SemanticLookupResponse(
            hit=hit, similarity=best.similarity if best else 0.0, token_ids=best.token_ids if hit else (),
            threshold=t)

    async def SemanticStore(self, request: cachestore_pb2.SemanticStoreRequest,
                            context) -> cachestore_pb2.SemanticStoreResponse:
        kind = _semantic_kind(request.kind)
        if not request.text or not request.token_ids:
            return cachestore_pb2.SemanticStoreResponse(stored=False)
        n = await self.semantic.store(request.tenant, kind, request.scope, request.text, tuple(request.token_ids))
        return cachestore_pb2.SemanticStoreResponse(stored=True, num_entries=n)

    async def PrefetchBlocks(self, request: cachestore_pb2.PrefetchBlocksRequest,
                             context) -> cachestore_pb2.PrefetchBlocksResponse:
        tokens = list(request.token_ids)

        def warm() -> tuple[int, int]:
            best = (0, 0)
            for model_id, block_size in sorted(self.store.layouts):
                hashes = hash_block_chain(tokens, block_size, extra_keys_for(model_id, request.tenant))
                found, warmed = self.store.warm(hashes)
                best = max(best, (found, warmed))
            return best

        found, warmed = await asyncio.to_thread(warm)
        if warmed:
            PROMOTIONS.labels("archived", "sleeping").inc(warmed)
        return cachestore_pb2.PrefetchBlocksResponse(num_found_blocks=found, num_warmed_blocks=warmed)

    async def ArchiveBlocks(self, request: cachestore_pb2.ArchiveBlocksRequest,
                            context) -> cachestore_pb2.ArchiveBlocksResponse:
        hashes = list(request.block_hashes)
        r = await asyncio.to_thread(self.store.archive, hashes)  # disk writes off the event loop
        export_tier_gauges(self.store)
        log.info("blocks_archived", num_archived=r.num_archived, num_already_archived=r.num_already_archived,
                 num_missing=r.num_missing, num_kept=r.num_kept)
        return cachestore_pb2.ArchiveBlocksResponse(
            num_archived_blocks=r.num_archived, num_already_archived_blocks=r.num_already_archived,
            num_missing_blocks=r.num_missing, num_kept_blocks=r.num_kept)


def _semantic_kind(value: int) -> SemanticKind:
    kind = _SEMANTIC_KINDS.get(value)
    if kind is None:
        raise InvalidQueryError("kind", "must be SEMANTIC_KIND_RESPONSE or SEMANTIC_KIND_SESSION_PREFIX")
    return kind
