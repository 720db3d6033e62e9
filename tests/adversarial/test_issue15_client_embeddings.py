"""Hostile /v1/embeddings client (issue 15): many maximal inputs in one request. Each
input was within the per-input caps, but together they made an Embed message over the
cachestore's gRPC limit (``CacheStoreConfig.max_message_bytes``, 8 MiB), refused with
RESOURCE_EXHAUSTED and answered 503 "retry shortly": a retry loop that can never pass.
The router now refuses the total before calling the cachestore, a 400 naming ``input``."""
from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from services.cachestore.config import CacheStoreConfig
from services.cachestore.disk_tier import DiskTier
from services.cachestore.errors import ERROR_RULES
from services.cachestore.host_tier import HostTier
from services.cachestore.semantic_service import SemanticService
from services.cachestore.server import CacheStoreServicer
from services.cachestore.tiers import TieredStore, TierPolicyName, make_tier_policy
from services.mesh.grpc_server import GrpcServer
from services.router.auth import KeyStore
from services.router.cachestore_client import CacheStoreClient
from services.router.embeddings import EMBEDDING_MODEL, MAX_INPUT_CHARS, MAX_INPUTS, EmbeddingsApi
from services.router.generation import Generator, model_limits
from services.router.http_api import HttpApi
from tests.unit.router.test_embeddings import embedder, tokenizer  # noqa: F401  (fixtures)
from weft.v1 import cachestore_pb2_grpc

HTTP_BODY_LIMIT = 1 << 24  # the router's (a 16 MiB body holds 256 inputs of 64K ASCII chars)


async def _post_embeddings(tmp_path, embedder, tokenizer, body):  # noqa: F811
    """One request through the router's HttpApi plumbing to a real cachestore gRPC server
    with the cachestore's default message limit; returns (status, JSON body)."""
    store = TieredStore(HostTier(1 << 20), DiskTier(tmp_path, 1 << 20, fsync=False),
                        make_tier_policy(TierPolicyName.DEMOTE_ON_EVICT))
    server = GrpcServer("weft.v1.CacheStore", "127.0.0.1", 0, rules=ERROR_RULES, grace_s=0.1,
                        max_message_bytes=CacheStoreConfig.max_message_bytes)
    cachestore_pb2_grpc.add_CacheStoreServicer_to_server(
        CacheStoreServicer(store, 1 << 20, 1 << 16, SemanticService(embedder)), server.server)
    port = await server.start()
    tok, path = tokenizer
    http = HttpApi(Generator(tok, model_limits(path, tok, ["tiny"], 512), None), KeyStore({}), "tiny")
    client = CacheStoreClient(f"127.0.0.1:{port}")
    api = EmbeddingsApi(client, tok)

    async def handler(request: web.Request) -> web.Response:
        return await api.handle(await http._json(request), http._tenant(request))

    app = web.Application(client_max_size=HTTP_BODY_LIMIT, middlewares=[http._errors])
    app.router.add_post("/v1/embeddings", handler)
    test_client = TestClient(TestServer(app))
    await test_client.start_server()
    try:
        resp = await test_client.post("/v1/embeddings", json=body)
        return resp.status, await resp.json()
    finally:
        await test_client.close()
        await client.close()
        await server.server.stop(0)


def test_inputs_too_big_together_for_one_embed_call_are_400_not_a_503_to_retry(tmp_path, embedder, tokenizer):  # noqa: F811
    count = 200  # each within MAX_INPUT_CHARS, 12.5 MiB together
    assert count <= MAX_INPUTS and count * MAX_INPUT_CHARS > CacheStoreConfig.max_message_bytes
    body = {"model": EMBEDDING_MODEL, "input": ["word " * (MAX_INPUT_CHARS // 5)] * count}
    status, reply = asyncio.run(_post_embeddings(tmp_path, embedder, tokenizer, body))
    assert status == 400, reply
    assert reply["error"]["param"] == "input" and "split it" in reply["error"]["message"]


def test_many_inputs_within_the_total_are_still_embedded(tmp_path, embedder, tokenizer):  # noqa: F811
    body = {"model": EMBEDDING_MODEL, "input": ["word " * 2000] * 32}  # 320 KB in all
    status, reply = asyncio.run(_post_embeddings(tmp_path, embedder, tokenizer, body))
    assert status == 200, reply
    assert len(reply["data"]) == 32 and len(reply["data"][0]["embedding"]) == 384
