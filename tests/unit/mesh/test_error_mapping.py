"""The one interceptor maps domain errors to gRPC codes (in-process aio server)."""
import asyncio

import grpc
import pytest

from services.mesh.grpc_server import RETRY_AFTER_KEY, DrainingError, ErrorRule, GrpcServer, retry_after_ms_of
from services.mesh.retry import is_retryable, rpc_retrying


class BadInput(ValueError):
    pass


class Overloaded(Exception):
    retry_after_ms = 250


RULES = (ErrorRule(BadInput, grpc.StatusCode.INVALID_ARGUMENT), ErrorRule(Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED))
ERRORS = {"bad": BadInput("prompt: empty"), "full": Overloaded("busy"), "drain": DrainingError("draining"),
          "bug": KeyError("oops")}


async def unary(request: bytes, context):
    key = request.decode()
    if key in ERRORS:
        raise ERRORS[key]
    return b"ok:" + request


async def stream(request: bytes, context):
    yield b"first"
    raise ERRORS[request.decode()]


def handlers():
    ident = lambda b: b  # noqa: E731
    return grpc.method_handlers_generic_handler("test.T", {
        "Unary": grpc.unary_unary_rpc_method_handler(unary, ident, ident),
        "Stream": grpc.unary_stream_rpc_method_handler(stream, ident, ident),
    })


async def with_server(fn):
    srv = GrpcServer("test.T", "127.0.0.1", 0, rules=RULES, grace_s=0.1)
    srv.server.add_generic_rpc_handlers((handlers(),))
    port = await srv.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            return await fn(ch)
    finally:
        await srv.drain()


@pytest.mark.parametrize("key, code, retry_ms", [
    ("bad", grpc.StatusCode.INVALID_ARGUMENT, None),
    ("full", grpc.StatusCode.RESOURCE_EXHAUSTED, 250),
    ("drain", grpc.StatusCode.UNAVAILABLE, None),
    ("bug", grpc.StatusCode.INTERNAL, None),
])
def test_domain_errors_map_to_status_codes(key, code, retry_ms):
    async def call(ch):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await ch.unary_unary("/test.T/Unary")(key.encode(), timeout=5)
        return err.value

    err = asyncio.run(with_server(call))
    assert err.code() == code
    assert retry_after_ms_of(err) == retry_ms
    if key == "bad":
        assert err.details() == "prompt: empty"
    if key == "bug":
        assert "oops" not in err.details()  # no internals leak to clients


def test_error_after_first_stream_message_is_mapped_too():
    async def call(ch):
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for msg in ch.unary_stream("/test.T/Stream")(b"full", timeout=5):
                got.append(msg)
        return got, err.value

    got, err = asyncio.run(with_server(call))
    assert got == [b"first"] and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(err.trailing_metadata())[RETRY_AFTER_KEY] == "250"


def test_retry_policy_retries_only_retryable_codes():
    async def call(ch):
        attempts = {"n": 0}

        async def once(key):
            async for attempt in rpc_retrying(max_attempts=3, initial_s=0.001, max_wait_s=0.01):
                with attempt:
                    attempts["n"] += 1
                    return await ch.unary_unary("/test.T/Unary")(key, timeout=5)

        for key, expected in ((b"bad", 1), (b"drain", 3)):
            attempts["n"] = 0
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await once(key)
            assert attempts["n"] == expected, key
            assert is_retryable(err.value) == (key == b"drain")
        return await once(b"x")

    assert asyncio.run(with_server(call)) == b"ok:x"
