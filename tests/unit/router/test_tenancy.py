"""Tenants apart at the public HTTP API (issue 12 §5): request ids are scoped per tenant,
the p99 verdict covers the caller's own requests, and a client hanging up is counted as
499 (client closed), never as a server error."""
from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from services.router import metrics as m
from services.router.attribution import ATTRIBUTION
from services.router.auth import KeyStore
from services.router.generation import Generator, model_limits
from services.router.http_api import HttpApi
from services.router.schema import TokenChunk, TokenRequest
from services.shared.tokenizer import Tokenizer
from tests.unit.router.test_p99_attribution import timeline
from tests.unit.router.test_http import MODEL, FakeDownstream, run
from weft.testing.tiny_model import make_tiny_checkpoint

KEYS = {"sk-a": "tenant-a", "sk-b": "tenant-b"}
A = {"Authorization": "Bearer sk-a"}
B = {"Authorization": "Bearer sk-b"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / MODEL
    make_tiny_checkpoint(path)
    return path


async def _client(model_dir, downstream_cls=FakeDownstream, **server_kwargs):
    tokenizer = Tokenizer.from_dir(model_dir)
    fake = downstream_cls(tokenizer)
    limits = model_limits(model_dir, tokenizer, [MODEL], max_model_len=512)
    api = HttpApi(Generator(tokenizer, limits, fake), KeyStore(KEYS), MODEL)
    client = TestClient(TestServer(api.app(1 << 20), **server_kwargs))
    await client.start_server()
    return client, fake


def test_a_tenant_claiming_an_id_first_neither_reads_nor_hides_anothers_timeline(model_dir):
    async def go():
        client, fake = await _client(model_dir)
        rid = {"x-request-id": "shared-id-1"}
        try:
            first = await client.post("/v1/chat/completions", json=CHAT, headers={**B, **rid})  # B claims it
            assert first.status == 200 and first.headers["x-request-id"] == "shared-id-1"
            second = await client.post("/v1/chat/completions", json=CHAT, headers={**A, **rid})
            assert second.status == 200 and second.headers["x-request-id"] == "shared-id-1"
            assert (await second.json())["id"] == "chatcmpl-shared-id-1"  # no tenant prefix leaks
            # Inside the mesh the two requests carry distinct ids.
            assert [r.request_id for r in fake.requests] == ["tenant-b/shared-id-1", "tenant-a/shared-id-1"]
            for headers, tenant in ((A, "tenant-a"), (B, "tenant-b")):
                resp = await client.get("/v1/weft/requests/shared-id-1/timeline", headers=headers)
                assert resp.status == 200
                doc = await resp.json()
                assert doc["request_id"] == "shared-id-1"
                roots = [s for s in doc["spans"] if s["name"] == "router.request"]
                assert [s["attrs"]["tenant"] for s in roots] == [tenant]  # its own request only
            # An id only A used is not found for B (and the answer does not say whose it is).
            await client.post("/v1/chat/completions", json=CHAT, headers={**A, "x-request-id": "only-a-2"})
            resp = await client.get("/v1/weft/requests/only-a-2/timeline", headers=B)
            assert resp.status == 404
        finally:
            await client.close()
    run(go())


def test_the_public_verdict_covers_only_the_callers_tenant(model_dir):
    async def go():
        client, _ = await _client(model_dir)
        try:
            for i in range(3):  # tenant-a: slow prefills; tenant-b: slow queueing, 5 requests
                ATTRIBUTION.observe(f"tenant-a/v{i}", timeline(f"v{i}", prefill_ms=400), tenant="tenant-a")
            for i in range(5):
                ATTRIBUTION.observe(f"tenant-b/v{i}", timeline(f"v{i}", queue_ms=900), tenant="tenant-b")
            a = await (await client.get("/v1/weft/verdict", headers=A)).json()
            b = await (await client.get("/v1/weft/verdict", headers=B)).json()
            assert a["num_requests"] == 3 and a["cause"] == "prefill"
            assert b["num_requests"] == 5 and b["cause"] == "queueing"
            # The operator's view (exported to the metrics port) still covers every tenant.
            assert ATTRIBUTION.verdict().num_requests >= 8
            assert (await client.get("/v1/weft/verdict")).status == 401
        finally:
            await client.close()
    run(go())


class EndlessDownstream:
    """Streams one token at a time until the router stops reading (a safety cap ends it)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.requests: list[TokenRequest] = []
        self.num_sent = 0

    async def generate(self, request: TokenRequest, timeout_s: float):
        self.requests.append(request)
        for n in range(1, 100_001):
            self.num_sent = n
            await asyncio.sleep(0)  # a chunk arrives on a later loop turn, as from the network
            yield TokenChunk((65,), (), "length" if n == 100_000 else None, 1, 0, n, "executor-7")


async def _counter_change(endpoint: str, before: dict[str, float], deadline_s: float = 10.0) -> dict[str, float]:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        now = {code: m.REQUESTS.labels("http", endpoint, code)._value.get() for code in before}
        if now != before:
            return now
        await asyncio.sleep(0.01)
    raise AssertionError(f"no request was counted for {endpoint}")


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {**CHAT, "max_tokens": None, "stream": True}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 500, "stream": True}),
])
@pytest.mark.parametrize("hang_up", ["close", "write_reset"])
def test_a_client_hanging_up_mid_stream_counts_as_499_not_500(model_dir, path, body, hang_up, monkeypatch):
    """``close``: the client drops the connection (the handler is cancelled);
    ``write_reset``: a write finds the connection reset (the race a real client wins)."""
    async def go():
        client, fake = await _client(model_dir, EndlessDownstream, handler_cancellation=True)
        codes = ("200", "499", "500")
        before = {c: m.REQUESTS.labels("http", path, c)._value.get() for c in codes}
        if hang_up == "write_reset":
            write, num_writes = web.StreamResponse.write, [0]

            async def reset_on_third_write(self, data):
                num_writes[0] += 1
                if num_writes[0] == 3:
                    raise ConnectionResetError("Cannot write to closing transport")
                return await write(self, data)
            monkeypatch.setattr(web.StreamResponse, "write", reset_on_third_write)
        try:
            resp = await client.post(path, json={k: v for k, v in body.items() if v is not None}, headers=A)
            assert resp.status == 200
            await resp.content.readline()  # the stream started
            resp.close()  # hang up mid-stream
            after = await _counter_change(path, before)
            assert after["499"] == before["499"] + 1
            assert after["500"] == before["500"] and after["200"] == before["200"]
            assert fake.num_sent < 100_000  # the stream stopped with the client
        finally:
            await client.close()
    run(go())
