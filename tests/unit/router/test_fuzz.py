"""Hypothesis fuzzing of the router's public surfaces against an in-process router with a
fake downstream: random JSON / bytes bodies over HTTP, random bytes and random field
values over gRPC. Asserted: no crash (never a 5xx / INTERNAL, and a valid request is
still served after the run) and no leak (asyncio tasks and open downstream streams
return to their baseline after the run)."""
from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.mesh.grpc_server import GrpcServer
from services.router.auth import KeyStore
from services.router.generation import Generator, model_limits
from services.router.http_api import HttpApi
from services.router.server import ROUTER_ERROR_RULES, RouterServicer
from services.shared.tokenizer import Tokenizer
from tests.unit.router.test_http import MODEL, FakeDownstream, model_dir  # noqa: F401  (fixture)
from weft.v1 import common_pb2, router_pb2, router_pb2_grpc

KEY = "sk-fuzz"
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
HTTP_OK = {200, 400, 401, 404, 413, 422, 429}
GRPC_OK = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED}

json_scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=12)
FIELDS = ["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stop",
          "seed", "tools", "tool_choice", "logprobs", "min_tokens", "ignore_eos", "return_token_ids",
          "session_id", "hop_index", "request_class", "stream_options", "max_completion_tokens"]
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | json_scalars},
                                optional={"content": json_values, "tool_call_id": json_values, "name": json_values})
bodies = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), json_values, max_size=8) | st.fixed_dictionaries(
    {"model": st.just(MODEL) | json_scalars},
    optional={"messages": st.lists(message, max_size=3) | json_values, "prompt": json_values,
              "max_tokens": st.integers(-5, 10**9) | json_scalars, "stream": st.booleans() | json_scalars,
              "n": st.integers(-2, 5), "stop": json_values, "temperature": json_scalars})


class CountingDownstream(FakeDownstream):
    """The fake scheduler, counting streams still open (a leak would leave some)."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.num_open = 0

    async def generate(self, request, timeout_s):
        self.num_open += 1
        try:
            async for chunk in super().generate(request, timeout_s):
                yield chunk
        finally:
            self.num_open -= 1


async def _num_tasks() -> int:
    return len(asyncio.all_tasks())


async def _settled(fake: CountingDownstream, baseline: int) -> tuple[int, int]:
    for _ in range(200):  # the deadline: 200 × 10 ms
        if fake.num_open == 0 and len(asyncio.all_tasks()) <= baseline:
            break
        await asyncio.sleep(0.01)
    return fake.num_open, len(asyncio.all_tasks())


def test_http_bodies_never_crash_the_router_nor_leak(model_dir):  # noqa: F811
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)  # grpc.aio calls made between run_until_complete calls find it
    tokenizer = Tokenizer.from_dir(model_dir)
    fake = CountingDownstream(tokenizer)
    api = HttpApi(Generator(tokenizer, model_limits(model_dir, tokenizer, [MODEL], max_model_len=512), fake),
                  KeyStore({KEY: "acme"}), MODEL)
    client = TestClient(TestServer(api.app(1 << 16)), loop=loop)
    loop.run_until_complete(client.start_server())
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}

    async def post(path: str, data: bytes) -> int:
        resp = await client.post(path, data=data, headers=headers)
        await resp.read()
        return resp.status

    try:
        warm = loop.run_until_complete(post("/v1/completions", json.dumps(
            {"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()))
        assert warm == 200
        baseline = loop.run_until_complete(_num_tasks())

        @FUZZ
        @given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
               body=bodies.map(lambda b: json.dumps(b).encode()) | st.binary(max_size=300))
        def fuzz(path, body):
            seen.append(path)
            status = loop.run_until_complete(post(path, body))
            assert status in HTTP_OK, (status, body[:200])

        seen: list = []
        fuzz()
        assert len(seen) >= 50  # the fuzzer really ran
        oversized = loop.run_until_complete(post("/v1/completions", b"{" + b" " * (1 << 17) + b"}"))
        assert oversized == 413
        ok = loop.run_until_complete(post("/v1/completions", json.dumps(
            {"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()))
        assert ok == 200
        num_open, num_tasks = loop.run_until_complete(_settled(fake, baseline))
        assert num_open == 0 and num_tasks <= baseline
    finally:
        loop.run_until_complete(client.close())
        loop.close()
        asyncio.set_event_loop(None)


sampling_values = st.builds(
    common_pb2.SamplingParams,
    max_tokens=st.integers(0, 2**32 - 1), temperature=st.floats(width=32), top_p=st.floats(width=32),
    top_k=st.integers(0, 2**32 - 1), min_tokens=st.integers(0, 2**32 - 1),
    stop_token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=4), ignore_eos=st.booleans(),
    seed=st.integers(0, 2**64 - 1))
grpc_requests = st.builds(
    router_pb2.GenerateRequest,
    request_id=st.text(max_size=80), model=st.just(MODEL) | st.text(max_size=10),
    text=st.text(max_size=200), sampling=sampling_values, stop=st.lists(st.text(max_size=10), max_size=3),
    return_logprobs=st.booleans()) | st.builds(
    router_pb2.GenerateRequest, token_ids=st.builds(router_pb2.TokenIds, ids=st.lists(
        st.integers(0, 2**32 - 1), max_size=50)), sampling=sampling_values) | st.builds(
    router_pb2.GenerateRequest, chat=st.builds(router_pb2.ChatMessages, messages=st.lists(st.builds(
        router_pb2.ChatMessage, role=st.sampled_from(["user", "system", "assistant", "tool", ""]),
        content=st.text(max_size=50), tool_call_id=st.text(max_size=5)), max_size=3),
        add_generation_prompt=st.booleans()), sampling=sampling_values)


def test_grpc_messages_never_crash_the_router_nor_leak(model_dir):  # noqa: F811
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)  # grpc.aio calls made between run_until_complete calls find it
    tokenizer = Tokenizer.from_dir(model_dir)
    fake = CountingDownstream(tokenizer)

    async def start():
        server = GrpcServer("weft.v1.Router", "127.0.0.1", 0, rules=ROUTER_ERROR_RULES, peer_auth=False)
        router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(
            Generator(tokenizer, model_limits(model_dir, tokenizer, [MODEL], max_model_len=512), fake),
            KeyStore({KEY: "acme"}), MODEL), server.server)
        port = await server.start()
        return server, grpc.aio.insecure_channel(f"127.0.0.1:{port}")

    server, channel = loop.run_until_complete(start())
    raw = channel.unary_stream("/weft.v1.Router/Generate", request_serializer=None, response_deserializer=None)
    stub = router_pb2_grpc.RouterStub(channel)
    meta = (("authorization", f"Bearer {KEY}"),)

    async def code_of(call) -> grpc.StatusCode:
        try:
            async for _ in call:
                pass
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            return exc.code()

    try:
        warm = loop.run_until_complete(code_of(stub.Generate(router_pb2.GenerateRequest(
            text="hi", sampling=common_pb2.SamplingParams(max_tokens=2)), metadata=meta, timeout=10)))
        assert warm == grpc.StatusCode.OK
        baseline = loop.run_until_complete(_num_tasks())

        @FUZZ
        @given(data=st.binary(max_size=400))
        def fuzz_bytes(data):
            seen.append(data)
            code = loop.run_until_complete(code_of(raw(data, metadata=meta, timeout=10)))
            assert code in GRPC_OK, (code, data[:100])

        @FUZZ
        @given(request=grpc_requests)
        def fuzz_fields(request):
            seen.append(request)
            code = loop.run_until_complete(code_of(stub.Generate(request, metadata=meta, timeout=10)))
            assert code in GRPC_OK, (code, request)

        seen: list = []
        fuzz_bytes()
        fuzz_fields()
        assert len(seen) >= 100  # the fuzzer really ran
        ok = loop.run_until_complete(code_of(stub.Generate(router_pb2.GenerateRequest(
            text="hi", sampling=common_pb2.SamplingParams(max_tokens=2)), metadata=meta, timeout=10)))
        assert ok == grpc.StatusCode.OK
        num_open, num_tasks = loop.run_until_complete(_settled(fake, baseline))
        assert num_open == 0 and num_tasks <= baseline
    finally:
        loop.run_until_complete(channel.close())
        loop.run_until_complete(server.server.stop(0))
        loop.close()
        asyncio.set_event_loop(None)


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
