"""The scheduler's client of ``weft.v1.CacheStore``: sentence embeddings for the intent
check and the archive tier for released KV. An outbound wire boundary, like
``executor_port.py``: protobuf stays here, callers see lists of floats and counts.

    embed(texts)            CacheStore.Embed (MiniLM, L2-normalised), one vector per text
    archive_blocks(hashes)  CacheStore.ArchiveBlocks: host RAM -> disk now

Neither call is retried: the intent check's caller bounds the embedding's wait and falls
back to bigrams on any error (policy/intent_shift.py); an archive that fails leaves the
blocks to the cachestore's own LRU. ``intent_detector`` builds the detector the agent
plane uses: embeddings of detokenised text when both a cachestore address and the
served model's tokenizer are given, bigrams alone otherwise.
"""
from __future__ import annotations

from collections.abc import Sequence

import structlog

from services.mesh.mesh_auth import mesh_channel
from services.scheduler.policy.intent_shift import (
    DEFAULT_EMBEDDING_THRESHOLD,
    IntentShiftDetector,
    make_intent_detector,
)
from weft.v1 import cachestore_pb2, cachestore_pb2_grpc

log = structlog.get_logger(__name__)


class CachestorePort:
    """One channel to the cachestore. ``embed_timeout_s`` is the gRPC deadline of an
    Embed (the intent check waits less and abandons it); ``archive_timeout_s`` that of an
    ArchiveBlocks, which writes to disk. Calls raise ``grpc.aio.AioRpcError``."""

    def __init__(self, address: str, embed_timeout_s: float = 2.0, archive_timeout_s: float = 30.0) -> None:
        if not address:
            raise ValueError("cachestore address must not be empty")
        self.address = address
        self.embed_timeout_s = embed_timeout_s
        self.archive_timeout_s = archive_timeout_s
        self._channel = mesh_channel(address)
        self._stub = cachestore_pb2_grpc.CacheStoreStub(self._channel)

    async def embed(self, texts: list[str]) -> list[list[float]]:
        reply = await self._stub.Embed(cachestore_pb2.EmbedRequest(texts=texts), timeout=self.embed_timeout_s)
        if len(reply.embeddings) != len(texts):
            raise ValueError(f"cachestore answered {len(reply.embeddings)} embeddings for {len(texts)} texts")
        return [list(e.values) for e in reply.embeddings]

    async def archive_blocks(self, block_hashes: Sequence[int]) -> int:
        """Move these blocks to the archive tier; returns how many moved now (the agent
        plane's ``KvArchive``)."""
        reply = await self._stub.ArchiveBlocks(cachestore_pb2.ArchiveBlocksRequest(block_hashes=list(block_hashes)),
                                               timeout=self.archive_timeout_s)
        return reply.num_archived_blocks

    async def close(self) -> None:
        await self._channel.close()


def intent_detector(port: CachestorePort | None, model_dir: str, bigram_threshold: float,
                    embedding_threshold: float = DEFAULT_EMBEDDING_THRESHOLD) -> IntentShiftDetector:
    """The agent plane's detector: the cachestore's embeddings of text the served model's
    tokenizer (``model_dir``) detokenises, with the bigram signal as fallback; bigrams
    alone when either is missing. Raises what ``Tokenizer.from_dir`` raises (a bad model
    dir is a configuration error at start)."""
    if port is None or not model_dir:
        log.info("intent_signal", signal="bigram", reason="no cachestore address" if port is None else "no model dir")
        return make_intent_detector(bigram_threshold=bigram_threshold)
    from services.shared.tokenizer import Tokenizer  # jinja2 + tokenizers: only when used

    tokenizer = Tokenizer.from_dir(model_dir)
    log.info("intent_signal", signal="embedding", cachestore=port.address, model_dir=model_dir)
    return make_intent_detector(detokenize=tokenizer.decode, embedding_threshold=embedding_threshold,
                                bigram_threshold=bigram_threshold, embed_async=port.embed)
