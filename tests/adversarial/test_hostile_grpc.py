"""A real router process against hostile gRPC clients (issue 12 §4-5): a huge prompt over
gRPC does not freeze either door, and an oversized ``request_id`` is refused before it
can reach a log line."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.adversarial.test_hostile_http import KEY, MAX_MODEL_LEN, health_answered_first, lone_router  # noqa: F401
from weft.v1 import common_pb2, router_pb2, router_pb2_grpc

METADATA = (("authorization", f"Bearer {KEY}"),)


def _channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=[("grpc.max_send_message_length", 32 << 20)])


async def _call(channel: grpc.aio.Channel, request: router_pb2.GenerateRequest) -> grpc.aio.AioRpcError | None:
    try:
        async for _ in router_pb2_grpc.RouterStub(channel).Generate(request, metadata=METADATA, timeout=120):
            pass
    except grpc.aio.AioRpcError as err:
        return err
    return None


async def _generate(address: str, request: router_pb2.GenerateRequest) -> grpc.aio.AioRpcError | None:
    async with _channel(address) as channel:
        return await _call(channel, request)


def test_both_doors_answer_health_while_a_huge_grpc_prompt_is_tokenized_and_refused(lone_router):
    request = router_pb2.GenerateRequest(text="hello world " * 45_000,
                                         sampling=common_pb2.SamplingParams(max_tokens=1))

    async def go():
        async with _channel(lone_router.address) as channel:
            await channel.channel_ready()  # connected first: the health calls race the prompt, not a handshake
            return await health_answered_first(lone_router.http, lambda: _call(channel, request))

    order, err = asyncio.run(go())
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("text:") and "tokens exceed" in err.details()
    assert order[-1] == "slow", order
    with grpc.insecure_channel(lone_router.address) as channel:  # gRPC health (liveness) too
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("form", ["text", "chat"])
def test_a_10mb_grpc_prompt_is_refused_naming_the_field_and_the_limit(lone_router, form):
    huge = "a" * (10 << 20)
    request = (router_pb2.GenerateRequest(text=huge) if form == "text" else router_pb2.GenerateRequest(
        chat=router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user", content=huge)])))
    err = asyncio.run(_generate(lone_router.address, request))
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    field = "text" if form == "text" else "chat.messages"
    assert err.details().startswith(f"{field}:") and "can never fit" in err.details()
    assert f"context length of {MAX_MODEL_LEN}" in err.details()


def test_a_4mb_request_id_is_refused_and_never_logged(lone_router):
    size_before = lone_router.log_path.stat().st_size
    for _ in range(5):
        err = asyncio.run(_generate(lone_router.address, router_pb2.GenerateRequest(
            request_id="x" * (4 << 20), text="hi", sampling=common_pb2.SamplingParams(max_tokens=1))))
        assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details().startswith("request_id:") and len(err.details()) < 200
    assert lone_router.log_path.stat().st_size - size_before < 64 * 1024  # not 5 x 4 MB of id
