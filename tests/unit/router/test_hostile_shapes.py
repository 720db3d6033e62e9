"""Request shapes found by attacking a live `weft up` mesh (issue 12 §4-5) that used to
answer HTTP 500 or to freeze the router's event loop for every client; each is now a
400 / INVALID_ARGUMENT naming the field, decided before anything is parsed deeply,
rendered or tokenized."""
from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from services.router.validation import Limits
from tests.unit.router.test_grpc import KEY, _serve
from tests.unit.router.test_http import MODEL, _client, run
from tests.unit.router.test_hostile_input import model_dir  # noqa: F401  (a module fixture)
from weft.v1 import common_pb2, router_pb2

LIMITS = Limits(served_models=(MODEL,), max_model_len=512, vocab_size=1000)


def _deep(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


def _tool_call_message(arguments: str, num_calls: int = 1) -> dict:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call] * num_calls}


def _post(model_dir, path: str, body: dict):
    async def go():
        client, fake = await _client(model_dir)
        try:
            resp = await client.post(path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
            return resp.status, await resp.json(), len(fake.requests)
        finally:
            await client.close()
    return run(go())


@pytest.mark.parametrize("arguments", [
    "[" * 100_000,  # json.loads raises RecursionError, not a JSONDecodeError: was a 500
    _deep(995),  # valid JSON, one level short of the body's own limit: was a 500
])
def test_too_deep_tool_call_arguments_are_400_naming_the_field(model_dir, arguments):  # noqa: F811
    body = {"model": MODEL, "max_tokens": 2, "messages": [_tool_call_message(arguments),
                                                          {"role": "user", "content": "x"}]}
    status, err, sent = _post(model_dir, "/v1/chat/completions", body)
    assert status == 400, err
    assert err["error"]["param"].startswith("messages"), err
    assert "deep" in err["error"]["message"]
    assert sent == 0


@pytest.mark.parametrize("body, field, words", [
    ({"messages": [{"role": "user", "content": ""}] * 2049}, "messages", "at most 2048 messages"),
    ({"messages": [_tool_call_message("{}", 2049)]}, "messages", "at most 2048 content parts and tool calls"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 2049}]}, "messages",
     "at most 2048 content parts and tool calls"),
    ({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools", "at most 128 tools"),
])
def test_conversations_too_big_to_walk_are_refused_by_count(model_dir, body, field, words):  # noqa: F811
    status, err, sent = _post(model_dir, "/v1/chat/completions", {"model": MODEL, "max_tokens": 2, **body})
    assert status == 400, err
    assert err["error"]["param"] == field and words in err["error"]["message"], err
    assert sent == 0


@pytest.mark.parametrize("field, value, words", [
    ("stop_token_ids", ["x"] * 100_000, "at most 64 ids, got 100000"),  # counted before each id is checked
    ("stop", [7] * 100_000, "at most 16 stop strings, got 100000"),
])
def test_long_lists_are_refused_by_their_length_before_their_items_are_walked(model_dir, field, value, words):  # noqa: F811
    status, err, _ = _post(model_dir, "/v1/completions", {"model": MODEL, "prompt": "x", field: value})
    assert status == 400 and err["error"]["param"] == field and words in err["error"]["message"], err


def test_grpc_refuses_more_chat_messages_than_http_does(model_dir):  # noqa: F811
    async def go():
        server, channel, stub, fake = await _serve(model_dir)
        try:
            chat = router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user", content="")] * 2049)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(router_pb2.GenerateRequest(chat=chat), metadata=KEY):
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith("chat.messages: at most 2048 messages"), err.value.details()
            assert fake.requests == []
        finally:
            await channel.close()
            await server.server.stop(0)
    asyncio.run(go())


def test_a_conversation_at_the_caps_still_passes(model_dir):  # noqa: F811
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": ""}] * 20
            + [_tool_call_message('{"a": ' + _deep(20) + "}", 2), {"role": "user", "content": "hi"}]}
    status, err, sent = _post(model_dir, "/v1/chat/completions", body)
    assert status == 200, err
    assert sent == 1


@pytest.mark.parametrize("field, value", [
    ("session_id", "s" * 500_000),  # echoed by the scheduler: a 10 MB log line and a bogus 429 each
    ("program_id", "p" * 500_000),
    ("session_id", "s" * 129),
    ("session_id", "new\nline"),
])
def test_session_and_program_ids_are_bounded_at_both_doors(model_dir, field, value):  # noqa: F811
    async def go():
        client, fake = await _client(model_dir)
        try:
            resp = await client.post("/v1/completions", data=json.dumps(
                {"model": MODEL, "prompt": "x", "max_tokens": 2, field: value}).encode())
            err = await resp.json()
            assert resp.status == 400 and err["error"]["param"] == field, err
            assert len(err["error"]["message"]) < 400  # names the size, never echoes the id
        finally:
            await client.close()
        server, channel, stub, fake2 = await _serve(model_dir)
        try:
            session = common_pb2.SessionInfo(**{field: value})
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(router_pb2.GenerateRequest(text="x", session=session), metadata=KEY):
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith(f"session.{field}:"), err.value.details()[:200]
            assert fake.requests == [] and fake2.requests == []
        finally:
            await channel.close()
            await server.server.stop(0)
    asyncio.run(go())


def test_ordinary_session_ids_pass(model_dir):  # noqa: F811
    status, err, sent = _post(model_dir, "/v1/completions", {
        "model": MODEL, "prompt": "x", "max_tokens": 2, "session_id": "conv_7f3a-9b2c.e:1 (retry)" + "x" * 100,
        "program_id": "agent/planner v2"})
    assert status == 200, err
    assert sent == 1


@pytest.mark.parametrize("request_kwargs, field", [
    ({"text": "x", "model": "m" * 1_000_000}, "model"),
    ({"chat": router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="r" * 1_000_000, content="hi")])},
     "chat.messages[0].role"),
])
def test_an_error_quoting_a_huge_field_stays_invalid_argument(model_dir, request_kwargs, field):  # noqa: F811
    """The details quoting a 1 MB value overflowed the status metadata: the client got
    RESOURCE_EXHAUSTED, which reads as "overloaded, retry" for a request that can never pass."""
    async def go():
        server, channel, stub, fake = await _serve(model_dir)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(router_pb2.GenerateRequest(**request_kwargs), metadata=KEY):
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()[:200]
            assert err.value.details().startswith(f"{field}:") and len(err.value.details()) < 2000
            assert fake.requests == []
        finally:
            await channel.close()
            await server.server.stop(0)
    asyncio.run(go())


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_named_as_such(model_dir, literal):  # noqa: F811
    async def go():
        client, _ = await _client(model_dir)
        try:
            resp = await client.post("/v1/completions", data=(
                '{"model": "%s", "prompt": "x", "temperature": %s}' % (MODEL, literal)).encode())
            err = (await resp.json())["error"]
            assert resp.status == 400 and err["param"] == "temperature"
            assert err["message"] == f"temperature: must be a finite number, got {float(literal)!r}"  # was "got number"
        finally:
            await client.close()
    run(go())


def test_an_api_key_of_undecodable_bytes_is_401_not_500(model_dir):  # noqa: F811
    async def go():
        client, _ = await _client(model_dir, keys={"sk-1": "acme"})
        try:
            reader, writer = await asyncio.open_connection(client.host, client.port)
            body = b'{"model": "tiny", "prompt": "x"}'
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n"
                         b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                         % (len(body), body))
            status_line = (await reader.readline()).decode()
            writer.close()
            assert status_line.split()[1] == "401", status_line
        finally:
            await client.close()
    run(go())


@pytest.mark.parametrize("window", ["nan", "inf", "-5", "0", "abc"])
def test_a_verdict_window_that_is_no_window_is_400(model_dir, window):  # noqa: F811
    async def go():
        client, _ = await _client(model_dir)
        try:
            resp = await client.get(f"/v1/weft/verdict?window_s={window}")
            err = await resp.json()
            assert resp.status == 400 and err["error"]["param"] == "window_s", err
        finally:
            await client.close()
    run(go())


@pytest.mark.parametrize("head, first_bytes", [
    (b"Content-Length: 100\r\n", b'{"mo'),  # a body that never completes
    (b"Transfer-Encoding: chunked\r\n", b'4\r\n{"mo\r\n'),  # a chunked body with no last chunk
])
def test_a_body_that_never_arrives_is_408_and_the_connection_closes(model_dir, head, first_bytes):  # noqa: F811
    """Such a client held its connection (an fd) and its handler forever: 1,500 of them sat on
    a live router for minutes; enough of them exhaust its file descriptors for everyone."""
    async def go():
        from services.router.auth import KeyStore
        from services.router.generation import Generator, model_limits
        from services.router.http_api import HttpApi
        from services.shared.tokenizer import Tokenizer
        from aiohttp.test_utils import TestClient, TestServer
        tokenizer = Tokenizer.from_dir(model_dir)
        limits = model_limits(model_dir, tokenizer, [MODEL], max_model_len=512)
        api = HttpApi(Generator(tokenizer, limits, None), KeyStore({}), MODEL, body_read_timeout_s=0.3)
        server = TestServer(api.app(1 << 20))
        await server.start_server(lingering_time=0.5)  # as the router's LINGER_S: the close need not wait 10 s
        client = TestClient(server)
        await client.start_server()
        try:
            reader, writer = await asyncio.open_connection(client.host, client.port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + head + b"\r\n" + first_bytes)
            status_line = await asyncio.wait_for(reader.readline(), 30)  # a deadline, not a measurement
            assert status_line.split()[1] == b"408", status_line
            rest = await asyncio.wait_for(reader.read(), 30)  # EOF: the server closed the connection
            assert b"not received within" in rest
            writer.close()
        finally:
            await client.close()
    run(go())


def _grpc_count(code: str) -> float:
    from services.router import metrics as m
    return m.REQUESTS.labels("grpc", "Generate", code)._value.get()


def test_grpc_calls_are_counted_under_their_status_names(model_dir):  # noqa: F811
    """A cancelled call was counted as ``CancelledError`` or ``GeneratorExit`` and a refused one
    not at all; HTTP counts both (499, 400)."""
    async def go():
        server, channel, stub, fake = await _serve(model_dir)
        before = {c: _grpc_count(c) for c in ("OK", "INVALID_ARGUMENT", "CANCELLED", "UNAUTHENTICATED")}
        try:
            [c async for c in stub.Generate(router_pb2.GenerateRequest(text="hi"), metadata=KEY)]
            with pytest.raises(grpc.aio.AioRpcError):
                [c async for c in stub.Generate(router_pb2.GenerateRequest(text="x", model="nope"), metadata=KEY)]
            with pytest.raises(grpc.aio.AioRpcError):
                [c async for c in stub.Generate(router_pb2.GenerateRequest(text="x"), metadata=(("x-api-key", "bad"),))]
            fake.gate = asyncio.Event()  # the stream stops after its first chunk until cancelled
            call = stub.Generate(router_pb2.GenerateRequest(text="hi"), metadata=KEY)
            async for _ in call:
                call.cancel()
                break
            await asyncio.wait_for(fake.cancelled.wait(), 30)
            async with asyncio.timeout(30):  # a deadline: the count follows the cancellation
                while _grpc_count("CANCELLED") == before["CANCELLED"]:
                    await asyncio.sleep(0.01)
            assert _grpc_count("OK") == before["OK"] + 1
            assert _grpc_count("INVALID_ARGUMENT") == before["INVALID_ARGUMENT"] + 1
            assert _grpc_count("UNAUTHENTICATED") == before["UNAUTHENTICATED"] + 1
        finally:
            await channel.close()
            await server.server.stop(0)
    asyncio.run(go())
