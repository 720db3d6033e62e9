"""/v1/embeddings with real parts: the router's HTTP error handling and auth, a real
cachestore gRPC server in-process running the real MiniLM checkpoint, and OpenAI's
Python client. Vectors must equal the model's own, bad input is a 400 naming the field,
a cachestore that is down is a 503 with Retry-After."""
from __future__ import annotations

import asyncio
import socket

import numpy as np
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from services.cachestore.disk_tier import DiskTier
from services.cachestore.embedder import MODEL_NAME, MiniLmEmbedder
from services.cachestore.errors import ERROR_RULES
from services.cachestore.host_tier import HostTier
from services.cachestore.semantic_service import SemanticService
from services.cachestore.server import CacheStoreServicer
from services.cachestore.tiers import TieredStore, TierPolicyName, make_tier_policy
from services.mesh.grpc_server import GrpcServer
from services.router.auth import KeyStore
from services.router.cachestore_client import CacheStoreClient
from services.router.embeddings import EMBEDDING_MODEL, MAX_INPUTS, EmbeddingsApi
from services.router.generation import Generator, model_limits
from services.router.http_api import HttpApi
from services.shared.tokenizer import Tokenizer
from weft.testing.tiny_model import make_tiny_checkpoint
from weft.v1 import cachestore_pb2_grpc

KEY = "sk-embed"


@pytest.fixture(scope="module")
def embedder():
    return MiniLmEmbedder(num_threads=1)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    make_tiny_checkpoint(path)
    return Tokenizer.from_dir(path), path


async def _router(tokenizer, cachestore_address: str, keys: dict[str, str]) -> tuple[TestClient, CacheStoreClient]:
    """The router's HttpApi plumbing (error middleware, _tenant, _json) with the route as
    http_api.py registers it."""
    tok, path = tokenizer
    http = HttpApi(Generator(tok, model_limits(path, tok, ["tiny"], 512), None), KeyStore(keys), "tiny")
    client = CacheStoreClient(cachestore_address)
    api = EmbeddingsApi(client, tok)

    async def handler(request: web.Request) -> web.Response:
        return await api.handle(await http._json(request), http._tenant(request))

    app = web.Application(client_max_size=1 << 22, middlewares=[http._errors])
    app.router.add_post("/v1/embeddings", handler)
    test_client = TestClient(TestServer(app))
    await test_client.start_server()
    return test_client, client


async def _with_mesh(tmp_path, embedder, tokenizer, fn, keys=None):
    store = TieredStore(HostTier(1 << 20), DiskTier(tmp_path, 1 << 20, fsync=False),
                        make_tier_policy(TierPolicyName.DEMOTE_ON_EVICT))
    server = GrpcServer("weft.v1.CacheStore", "127.0.0.1", 0, rules=ERROR_RULES, grace_s=0.1)
    cachestore_pb2_grpc.add_CacheStoreServicer_to_server(
        CacheStoreServicer(store, 1 << 20, 1 << 16, SemanticService(embedder)), server.server)
    port = await server.start()
    http, client = await _router(tokenizer, f"127.0.0.1:{port}", keys or {})
    try:
        await fn(http)
    finally:
        await http.close()
        await client.close()
        await server.server.stop(0)


def _openai(http: TestClient, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key=key, max_retries=0)


def test_openai_client_gets_the_models_vectors_and_usage(tmp_path, embedder, tokenizer):
    texts = ["Cancel my subscription, please.", "The weather is nice today."]
    expected = embedder.embed(texts).numpy()
    counts = embedder.embed_counted(texts)[1]

    async def go(http):
        oai = _openai(http)
        many = await oai.embeddings.create(model=EMBEDDING_MODEL, input=texts)  # the SDK asks for base64
        assert many.model == MODEL_NAME and [d.index for d in many.data] == [0, 1]
        np.testing.assert_allclose(np.array([d.embedding for d in many.data]), expected, atol=1e-6)
        assert many.usage.prompt_tokens == many.usage.total_tokens == sum(counts)
        floats = await oai.embeddings.create(model=EMBEDDING_MODEL, input=texts[0], encoding_format="float",
                                             dimensions=384, user="u1")
        assert len(floats.data) == 1 and floats.usage.prompt_tokens == counts[0]
        np.testing.assert_allclose(floats.data[0].embedding, expected[0], atol=1e-6)
        await oai.close()
    asyncio.run(_with_mesh(tmp_path, embedder, tokenizer, go, keys={KEY: "acme"}))


def test_token_ids_are_decoded_with_the_served_models_tokenizer(tmp_path, embedder, tokenizer):
    tok, _ = tokenizer
    ids = tok.encode("hello world", add_special_tokens=False)
    expected = embedder.embed([tok.decode(ids)]).numpy()

    async def go(http):
        for body_input in (ids, [ids, ids]):
            resp = await http.post("/v1/embeddings", json={"model": EMBEDDING_MODEL, "input": body_input})
            body = await resp.json()
            assert resp.status == 200, body
            for item in body["data"]:
                np.testing.assert_allclose(item["embedding"], expected[0], atol=1e-6)
    asyncio.run(_with_mesh(tmp_path, embedder, tokenizer, go))


@pytest.mark.parametrize("fields, param", [
    ({"model": "tiny"}, "model"),  # the chat model is not an embedding model
    ({"model": None}, "model"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input[1]"),
    ({"input": ["ok", 3.5]}, "input[1]"),
    ({"input": {"text": "x"}}, "input"),
    ({"input": ["x"] * (MAX_INPUTS + 1)}, "input"),
    ({"input": "x" * (64 * 1024 + 1)}, "input"),
    ({"input": ["hello", [3, 10**9]]}, "input[1][1]"),
    ({"input": [1, -1]}, "input[1]"),
    ({"input": [1, 10**50]}, "input[1]"),
    ({"encoding_format": "int8"}, "encoding_format"),
    ({"dimensions": 128}, "dimensions"),
    ({"dimensions": True}, "dimensions"),
    ({"user": 7}, "user"),
])
def test_bad_input_is_400_naming_the_field(tmp_path, embedder, tokenizer, fields, param):
    async def go(http):
        resp = await http.post("/v1/embeddings", json={"model": EMBEDDING_MODEL, "input": "hi", **fields})
        body = await resp.json()
        assert resp.status == 400, body
        assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error"
    asyncio.run(_with_mesh(tmp_path, embedder, tokenizer, go))


def test_missing_or_unknown_key_is_401_when_keys_are_configured(tmp_path, embedder, tokenizer):
    async def go(http):
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
            resp = await http.post("/v1/embeddings", json={"model": EMBEDDING_MODEL, "input": "hi"}, headers=headers)
            assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            await _openai(http, "sk-wrong").embeddings.create(model=EMBEDDING_MODEL, input="hi")
    asyncio.run(_with_mesh(tmp_path, embedder, tokenizer, go, keys={KEY: "acme"}))


def test_cachestore_down_is_503_with_retry_after(tokenizer):
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"

    async def go():
        http, client = await _router(tokenizer, dead, {})
        try:
            resp = await http.post("/v1/embeddings", json={"model": EMBEDDING_MODEL, "input": "hi"})
            body = await resp.json()
            assert resp.status == 503 and resp.headers["Retry-After"] == "1", body
            assert "embedding service" in body["error"]["message"]
        finally:
            await http.close()
            await client.close()
    asyncio.run(go())
