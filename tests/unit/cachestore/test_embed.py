"""CacheStore.Embed reports what /v1/embeddings bills and names: the word pieces the
model read of each text (after truncation) and the embedding model's id. Real MiniLM
checkpoint over an in-process gRPC server."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from services.cachestore.disk_tier import DiskTier
from services.cachestore.embedder import EMBEDDING_DIM, MAX_TOKENS, MODEL_NAME, MiniLmEmbedder
from services.cachestore.errors import ERROR_RULES
from services.cachestore.host_tier import HostTier
from services.cachestore.semantic_service import SemanticService
from services.cachestore.server import CacheStoreServicer
from services.cachestore.tiers import TieredStore, TierPolicyName, make_tier_policy
from services.mesh.grpc_server import GrpcServer
from weft.v1 import cachestore_pb2, cachestore_pb2_grpc


@pytest.fixture(scope="module")
def embedder():
    return MiniLmEmbedder(num_threads=1)


async def _embed(tmp_path, embedder, texts):
    store = TieredStore(HostTier(1 << 20), DiskTier(tmp_path, 1 << 20, fsync=False),
                        make_tier_policy(TierPolicyName.DEMOTE_ON_EVICT))
    server = GrpcServer("weft.v1.CacheStore", "127.0.0.1", 0, rules=ERROR_RULES, grace_s=0.1)
    servicer = CacheStoreServicer(store, 1 << 20, 1 << 16, SemanticService(embedder))
    cachestore_pb2_grpc.add_CacheStoreServicer_to_server(servicer, server.server)
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            return await cachestore_pb2_grpc.CacheStoreStub(ch).Embed(cachestore_pb2.EmbedRequest(texts=texts))
    finally:
        await server.server.stop(0)


def test_embed_reports_model_and_word_pieces_per_text(tmp_path, embedder):
    texts = ["hello world", "the quick brown fox jumps over the lazy dog", "word " * 1000]
    reply = asyncio.run(_embed(tmp_path, embedder, texts))
    assert reply.model == MODEL_NAME and reply.dim == EMBEDDING_DIM
    # [CLS] + word pieces + [SEP], counted per text (padding in the batch is not billed).
    expected = [len(embedder._tokenizer.encode(t)) for t in texts]
    assert list(reply.num_tokens) == expected
    assert expected[0] == 4 and expected[2] == MAX_TOKENS  # the long text was truncated, and counted so


def test_embed_of_nothing_reports_no_counts(tmp_path, embedder):
    reply = asyncio.run(_embed(tmp_path, embedder, []))
    assert list(reply.num_tokens) == [] and len(reply.embeddings) == 0 and reply.model == MODEL_NAME
