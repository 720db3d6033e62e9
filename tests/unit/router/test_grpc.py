"""The public gRPC Router servicer against a fake downstream (in-process server, no mesh)."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from services.mesh.grpc_server import GrpcServer
from services.router.auth import KeyStore
from services.router.generation import Generator, model_limits
from services.router.server import ROUTER_ERROR_RULES, RouterServicer
from services.shared.tokenizer import Tokenizer
from tests.unit.router.test_http import MODEL, FakeDownstream
from weft.testing.tiny_model import make_tiny_checkpoint
from weft.v1 import common_pb2, router_pb2, router_pb2_grpc

KEY = (("authorization", "Bearer sk-1"),)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / MODEL
    make_tiny_checkpoint(path)
    return path


async def _serve(model_dir):
    tokenizer = Tokenizer.from_dir(model_dir)
    fake = FakeDownstream(tokenizer)
    limits = model_limits(model_dir, tokenizer, [MODEL], max_model_len=512)
    server = GrpcServer("weft.v1.Router", "127.0.0.1", 0, rules=ROUTER_ERROR_RULES)
    router_pb2_grpc.add_RouterServicer_to_server(
        RouterServicer(Generator(tokenizer, limits, fake), KeyStore({"sk-1": "acme"}), MODEL), server.server)
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return server, channel, router_pb2_grpc.RouterStub(channel), fake


def test_generate_streams_text_ids_usage_and_executor_for_every_prompt_form(model_dir):
    async def go():
        server, channel, stub, fake = await _serve(model_dir)
        try:
            sampling = common_pb2.SamplingParams(max_tokens=3, temperature=0)
            requests = [
                router_pb2.GenerateRequest(text="hello", sampling=sampling),
                router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[5, 6, 7]), sampling=sampling),
                router_pb2.GenerateRequest(chat=router_pb2.ChatMessages(
                    messages=[router_pb2.ChatMessage(role="user", content="hi")], add_generation_prompt=True),
                    sampling=sampling),
            ]
            for req in requests:
                chunks = [c async for c in stub.Generate(req, metadata=KEY)]
                assert sum(len(c.token_ids_delta) for c in chunks) == 3
                assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
                assert chunks[-1].usage.num_output_tokens == 3 and chunks[-1].executor == "executor-7"
                text = "".join(c.text_delta for c in chunks)
                assert text and "Hello there".startswith(text)
            assert fake.requests[1].prompt_token_ids == (5, 6, 7)
            assert fake.requests[0].tenant == "acme"
        finally:
            await channel.close()
            await server.server.stop(0)
    asyncio.run(go())


@pytest.mark.parametrize("request_kwargs, metadata, code, field", [
    ({"token_ids": router_pb2.TokenIds(ids=[1])}, (), grpc.StatusCode.UNAUTHENTICATED, None),
    ({}, KEY, grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    ({"model": "other", "text": "x"}, KEY, grpc.StatusCode.INVALID_ARGUMENT, "model"),
    ({"token_ids": router_pb2.TokenIds(ids=[1, 99999])}, KEY, grpc.StatusCode.INVALID_ARGUMENT, "token_ids[1]"),
    ({"text": "x", "sampling": common_pb2.SamplingParams(temperature=5)}, KEY, grpc.StatusCode.INVALID_ARGUMENT,
     "sampling.temperature"),
    ({"text": "x", "sampling": common_pb2.SamplingParams(max_tokens=100000)}, KEY, grpc.StatusCode.INVALID_ARGUMENT,
     "sampling.max_tokens"),
])
def test_bad_requests_map_to_status_codes_naming_the_field(model_dir, request_kwargs, metadata, code, field):
    async def go():
        server, channel, stub, _ = await _serve(model_dir)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(router_pb2.GenerateRequest(**request_kwargs), metadata=metadata):
                    pass
            assert err.value.code() == code
            if field:
                assert err.value.details().startswith(f"{field}:")
        finally:
            await channel.close()
            await server.server.stop(0)
    asyncio.run(go())
