"""The OpenAI-compatible HTTP API against a fake downstream (no processes, no model)."""
from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.router.auth import KeyStore
from services.router.generation import Generator, model_limits
from services.router.http_api import EXECUTOR_HEADER, HttpApi
from services.router.schema import TokenChunk, TokenRequest
from services.shared.tokenizer import Tokenizer
from weft.testing.tiny_model import make_tiny_checkpoint

MODEL = "tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / MODEL
    make_tiny_checkpoint(path)
    return path


class FakeDownstream:
    """Streams the tokens of ``reply`` one per chunk; records requests and cancellations."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.reply = "Hello there"
        self.requests: list[TokenRequest] = []
        self.cancelled = asyncio.Event()
        self.gate: asyncio.Event | None = None

    async def generate(self, request: TokenRequest, timeout_s: float):
        self.requests.append(request)
        ids = self.tokenizer.encode(self.reply, add_special_tokens=False)[: request.sampling.max_tokens]
        try:
            for n, tok in enumerate(ids, 1):
                if self.gate is not None and n == 2:
                    await self.gate.wait()
                last = n == len(ids)
                yield TokenChunk((tok,), (), ("length" if n == request.sampling.max_tokens else "stop") if last else None,
                                 len(request.prompt_token_ids), 0, n, "executor-7")
        except (GeneratorExit, asyncio.CancelledError):
            self.cancelled.set()
            raise


def run(coro):
    return asyncio.run(coro)


async def _client(model_dir, keys: dict | None = None):
    tokenizer = Tokenizer.from_dir(model_dir)
    fake = FakeDownstream(tokenizer)
    limits = model_limits(model_dir, tokenizer, [MODEL], max_model_len=512)
    api = HttpApi(Generator(tokenizer, limits, fake), KeyStore(keys or {}), MODEL)
    client = TestClient(TestServer(api.app(1 << 20)))
    await client.start_server()
    return client, fake


def _sse(text: str) -> list:
    events = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_chat_non_streaming_returns_text_usage_and_executor_header(model_dir):
    async def go():
        client, fake = await _client(model_dir)
        try:
            resp = await client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "return_token_ids": True})
            body = await resp.json()
            assert resp.status == 200, body
            assert resp.headers[EXECUTOR_HEADER] == "executor-7"
            choice = body["choices"][0]
            assert choice["message"]["content"] == "Hello there"
            assert choice["finish_reason"] == "stop"
            assert body["usage"]["completion_tokens"] == len(choice["token_ids"])
            assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
            # The chat template went downstream as token ids, with room left in the context.
            sent = fake.requests[0]
            assert sent.sampling.max_tokens == 512 - len(sent.prompt_token_ids)
        finally:
            await client.close()
    run(go())


def test_chat_stream_emits_role_content_finish_usage_and_done(model_dir):
    async def go():
        client, _ = await _client(model_dir)
        try:
            resp = await client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
                "stream_options": {"include_usage": True}})
            assert resp.status == 200
            chunks = _sse(await resp.text())
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
            assert text == "Hello there"
            assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
        finally:
            await client.close()
    run(go())


def test_tool_call_output_becomes_openai_tool_calls(model_dir):
    async def go():
        client, fake = await _client(model_dir)
        fake.reply = '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'
        tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
        messages = [{"role": "user", "content": "time?"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
        try:
            for stream in (False, True):
                resp = await client.post("/v1/chat/completions", json={
                    "model": MODEL, "messages": messages, "tools": tools, "stream": stream})
                assert resp.status == 200, await resp.text()
                if stream:  # OpenAI's shape: index, id, type, name, arguments "" first; then fragments
                    chunks = _sse(await resp.text())
                    deltas = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
                    reason = chunks[-1]["choices"][0]["finish_reason"]
                    assert not any(c["choices"][0]["delta"].get("content") for c in chunks)
                    head, *fragments = deltas
                    assert head["index"] == 0 and head["type"] == "function" and head["id"].startswith("call_")
                    assert head["function"]["arguments"] == ""
                    assert all(set(f) == {"index", "function"} and set(f["function"]) == {"arguments"}
                               for f in fragments)
                    calls = [{"function": {"name": head["function"]["name"], "arguments": "".join(
                        f["function"]["arguments"] for f in fragments)}}]
                else:
                    choice = (await resp.json())["choices"][0]
                    calls, reason = choice["message"]["tool_calls"], choice["finish_reason"]
                assert reason == "tool_calls"
                assert [c["function"]["name"] for c in calls] == ["get_time"]
                assert json.loads(calls[0]["function"]["arguments"]) == {"tz": "UTC"}
        finally:
            await client.close()
    run(go())


def test_stop_string_cuts_text_and_cancels_downstream(model_dir):
    async def go():
        client, fake = await _client(model_dir)
        try:
            resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stop": " the",
                                                              "max_tokens": 30})
            body = await resp.json()
            assert body["choices"][0]["text"] == "Hello"
            assert body["choices"][0]["finish_reason"] == "stop"
            assert fake.cancelled.is_set()
        finally:
            await client.close()
    run(go())


@pytest.mark.parametrize("body, field", [
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": MODEL}, "messages"),
    ({"model": MODEL, "messages": "hi"}, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**9}, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x y " * 600}]}, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
])
def test_bad_chat_input_is_400_naming_the_field_and_next_request_is_served(model_dir, body, field):
    async def go():
        client, _ = await _client(model_dir)
        try:
            resp = await client.post("/v1/chat/completions", json=body)
            err = await resp.json()
            assert resp.status == 400, err
            assert err["error"]["param"] == field
            assert err["error"]["type"] == "invalid_request_error"
            ok = await client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert ok.status == 200
        finally:
            await client.close()
    run(go())


@pytest.mark.parametrize("prompt, field", [
    ([], "prompt"), ([1, -3], "prompt[1]"), ([[1, 2], [5000]], "prompt[1][0]"), ([1, True], "prompt[1]"),
    (list(range(600)), "prompt"), ({"a": 1}, "prompt"),
])
def test_bad_completion_prompts_are_400_naming_the_field(model_dir, prompt, field):
    async def go():
        client, _ = await _client(model_dir)
        try:
            resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
            err = await resp.json()
            assert resp.status == 400, err
            assert err["error"]["param"] == field
        finally:
            await client.close()
    run(go())


def test_malformed_json_is_400(model_dir):
    async def go():
        client, _ = await _client(model_dir)
        try:
            resp = await client.post("/v1/completions", data=b"{not json", headers={"Content-Type": "application/json"})
            assert resp.status == 400
            assert (await resp.json())["error"]["param"] == "body"
        finally:
            await client.close()
    run(go())


def test_completions_with_several_token_prompts_return_one_choice_each(model_dir):
    async def go():
        client, _ = await _client(model_dir)
        try:
            resp = await client.post("/v1/completions", json={
                "model": MODEL, "prompt": [[5, 6, 7], [8, 9]], "max_tokens": 2, "return_token_ids": True})
            body = await resp.json()
            assert [c["index"] for c in body["choices"]] == [0, 1]
            assert all(len(c["token_ids"]) == 2 and c["finish_reason"] == "length" for c in body["choices"])
            assert body["usage"]["prompt_tokens"] == 5
        finally:
            await client.close()
    run(go())


def test_keys_configured_missing_key_is_401_and_valid_key_passes(model_dir):
    async def go():
        client, _ = await _client(model_dir, keys={"sk-good": "acme"})
        try:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            resp = await client.post("/v1/chat/completions", json=body)
            assert resp.status == 401
            assert (await resp.json())["error"]["type"] == "authentication_error"
            resp = await client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-bad"})
            assert resp.status == 401
            resp = await client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-good"})
            assert resp.status == 200
        finally:
            await client.close()
    run(go())


def test_client_disconnect_mid_stream_cancels_downstream(model_dir):
    async def go():
        client, fake = await _client(model_dir)
        fake.gate = asyncio.Event()  # hold the stream after its first token
        try:
            resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True,
                                                              "max_tokens": 5})
            assert resp.status == 200
            await resp.content.readline()  # the first event arrived
            resp.close()  # drop the connection
            await asyncio.wait_for(fake.cancelled.wait(), timeout=5)
        finally:
            await client.close()
    run(go())


def test_draining_router_refuses_new_work_with_503_and_reports_unhealthy(model_dir):
    async def go():
        tokenizer = Tokenizer.from_dir(model_dir)
        limits = model_limits(model_dir, tokenizer, [MODEL], max_model_len=512)
        api = HttpApi(Generator(tokenizer, limits, FakeDownstream(tokenizer)), KeyStore({}), MODEL)
        client = TestClient(TestServer(api.app(1 << 20)))
        await client.start_server()
        try:
            api.draining = True
            resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})
            assert resp.status == 503
            assert (await client.get("/health")).status == 503
        finally:
            await client.close()
    run(go())
