"""Input caps and authentication of every public HTTP method (health stays open for
probes; metrics are not on the public port at all: test_router_metrics_port.py)."""
from __future__ import annotations

import asyncio

from aiohttp.test_utils import TestClient, TestServer

from services.router.auth import KeyStore
from services.router.generation import Generator, model_limits
from services.router.http_api import HttpApi
from services.shared.tokenizer import Tokenizer
from tests.unit.router.test_http import MODEL, FakeDownstream, model_dir  # noqa: F401  (fixture)

KEY = {"Authorization": "Bearer sk-caps"}


async def _client(model_dir, max_body_bytes=1 << 20):  # noqa: F811
    tokenizer = Tokenizer.from_dir(model_dir)
    api = HttpApi(Generator(tokenizer, model_limits(model_dir, tokenizer, [MODEL], max_model_len=64),
                            FakeDownstream(tokenizer)), KeyStore({"sk-caps": "acme"}), MODEL)
    client = TestClient(TestServer(api.app(max_body_bytes)))
    await client.start_server()
    return client


def test_every_public_method_needs_a_key_but_health_stays_open_and_metrics_are_not_served(model_dir):  # noqa: F811
    async def go():
        client = await _client(model_dir)
        try:
            for method, path in (("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                                 ("GET", "/v1/models"), ("GET", "/v1/weft/verdict"),
                                 ("GET", "/v1/weft/requests/x/timeline")):
                resp = await client.request(method, path, json={})
                assert resp.status == 401, (path, resp.status)
            assert (await client.get("/health")).status == 200
            for headers in ({}, KEY):  # per-tenant series never leave through the public port
                assert (await client.get("/metrics", headers=headers)).status == 404
        finally:
            await client.close()
    asyncio.run(go())


def test_caps_name_the_field(model_dir):  # noqa: F811
    async def go():
        client = await _client(model_dir, max_body_bytes=4096)
        try:
            base = {"model": MODEL, "prompt": "hi"}
            cases = [
                ({**base, "n": 10**6}, "n"),
                ({**base, "max_tokens": 10_000}, "max_tokens"),
                ({**base, "prompt": "word " * 200}, "prompt"),
                ({**base, "stop": ["a"] * 17}, "stop"),
                ({**base, "stop_token_ids": [1] * 65}, "stop_token_ids"),
            ]
            for body, field in cases:
                resp = await client.post("/v1/completions", json=body, headers=KEY)
                assert resp.status == 400, (field, resp.status)
                assert field in (await resp.json())["error"]["message"], field
            resp = await client.post("/v1/completions", data=b"x" * 5000, headers=KEY)
            assert resp.status == 413
        finally:
            await client.close()
    asyncio.run(go())
