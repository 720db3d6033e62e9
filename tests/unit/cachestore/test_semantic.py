"""The semantic index with the real all-MiniLM-L6-v2 (offline): the threshold's
precision on the built-in paraphrase set, tenant and scope isolation, and the RPCs."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from services.cachestore.disk_tier import DiskTier
from services.cachestore.embedder import EMBEDDING_DIM, MiniLmEmbedder
from services.cachestore.errors import ERROR_RULES
from services.cachestore.host_tier import HostTier
from services.cachestore.paraphrase_set import NON_PARAPHRASES, PARAPHRASES, choose_threshold, score, similarities
from services.cachestore.semantic import DEFAULT_THRESHOLD, SemanticIndex, SemanticKind
from services.cachestore.semantic_service import SemanticService
from services.cachestore.server import CacheStoreServicer
from services.cachestore.tiers import TieredStore, TierPolicyName, make_tier_policy
from services.mesh.grpc_server import GrpcServer
from weft.v1 import cachestore_pb2, cachestore_pb2_grpc


@pytest.fixture(scope="module")
def embedder():
    return MiniLmEmbedder()


@pytest.fixture(scope="module")
def pair_similarities(embedder):
    return similarities(embedder)


def test_embeddings_are_unit_vectors_of_minilm_dimension(embedder):
    e = embedder.embed(["hello world", "a much longer sentence about KV caches " * 50])
    assert e.shape == (2, EMBEDDING_DIM)
    assert e.norm(dim=-1).sub(1).abs().max() < 1e-5


def test_default_threshold_has_full_precision_on_the_built_in_set(pair_similarities):
    pos, neg = pair_similarities
    assert len(pos) + len(neg) == len(PARAPHRASES) + len(NON_PARAPHRASES) >= 40
    precision, recall = score(pos, neg, DEFAULT_THRESHOLD)
    print(f"threshold={DEFAULT_THRESHOLD} precision={precision:.3f} recall={recall:.3f}")
    assert precision == 1.0
    assert recall >= 0.5  # the cache still answers at least half of the paraphrases
    assert choose_threshold(pos, neg).threshold == DEFAULT_THRESHOLD  # the constant is what the set chooses


def test_tenants_and_scopes_never_see_each_others_entries(embedder):
    index = SemanticIndex(DEFAULT_THRESHOLD)
    q = "How do I reset my password?"
    vec = embedder.embed([q])[0]
    index.store("acme", SemanticKind.RESPONSE, "m|greedy|64", q, vec, (1, 2, 3))
    assert index.lookup("acme", SemanticKind.RESPONSE, "m|greedy|64", vec).token_ids == (1, 2, 3)
    assert index.lookup("globex", SemanticKind.RESPONSE, "m|greedy|64", vec) is None
    assert index.lookup("acme", SemanticKind.RESPONSE, "m|greedy|128", vec) is None
    assert index.lookup("acme", SemanticKind.SESSION_PREFIX, "m|greedy|64", vec) is None


def test_semantic_rpcs_hit_paraphrases_and_refuse_bad_input(tmp_path, embedder):
    async def go():
        store = TieredStore(HostTier(1 << 20), DiskTier(tmp_path, 1 << 20, fsync=False),
                            make_tier_policy(TierPolicyName.DEMOTE_ON_EVICT))
        server = GrpcServer("weft.v1.CacheStore", "127.0.0.1", 0, rules=ERROR_RULES, grace_s=0.1)
        servicer = CacheStoreServicer(store, 1 << 20, 1 << 16, SemanticService(embedder))
        cachestore_pb2_grpc.add_CacheStoreServicer_to_server(servicer, server.server)
        port = await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = cachestore_pb2_grpc.CacheStoreStub(ch)
            kind = cachestore_pb2.SEMANTIC_KIND_RESPONSE
            await stub.SemanticStore(cachestore_pb2.SemanticStoreRequest(
                tenant="acme", kind=kind, scope="s", text="Cancel my subscription, please.", token_ids=[7, 8]))
            hit = await stub.SemanticLookup(cachestore_pb2.SemanticLookupRequest(
                tenant="acme", kind=kind, scope="s", text="Please cancel my subscription."))
            assert hit.hit and list(hit.token_ids) == [7, 8] and hit.similarity >= DEFAULT_THRESHOLD
            miss = await stub.SemanticLookup(cachestore_pb2.SemanticLookupRequest(
                tenant="acme", kind=kind, scope="s", text="Upgrade my subscription, please."))
            assert not miss.hit and list(miss.token_ids) == []
            other = await stub.SemanticLookup(cachestore_pb2.SemanticLookupRequest(
                tenant="globex", kind=kind, scope="s", text="Cancel my subscription, please."))
            assert not other.hit
            sim = await stub.Similarity(cachestore_pb2.SimilarityRequest(
                text_a="Restart the web server.", text_b="Please restart the web server."))
            assert sim.similar and sim.threshold == pytest.approx(DEFAULT_THRESHOLD)
            emb = await stub.Embed(cachestore_pb2.EmbedRequest(texts=["a", "b"]))
            assert emb.dim == EMBEDDING_DIM and len(emb.embeddings) == 2
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.SemanticLookup(cachestore_pb2.SemanticLookupRequest(tenant="acme", text="x"))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "kind" in err.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Embed(cachestore_pb2.EmbedRequest(texts=["x"] * 1000))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "texts" in err.value.details()
        await server.server.stop(0)
    asyncio.run(go())
