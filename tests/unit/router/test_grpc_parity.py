"""The public gRPC door matches HTTP: what a client leaves unset means the same at both
doors, and the port describes itself through server reflection (grpcurl, Postman).

In-process; the parity cases drive one ``Generator`` through both doors and compare the
sampling the downstream receives, so a default that drifts at either door fails here."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer
from google.protobuf import descriptor_pool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from services.mesh.grpc_server import GrpcServer
from services.router.app import RouterApp
from services.router.auth import KeyStore
from services.router.config import RouterConfig
from services.router.generation import Generator, model_limits
from services.router.http_api import HttpApi
from services.router.server import ROUTER_ERROR_RULES, RouterServicer, add_router_to_server
from services.shared.tokenizer import Tokenizer
from tests.unit.router.test_http import FakeDownstream
from weft.testing.tiny_model import make_tiny_checkpoint
from weft.v1 import common_pb2, router_pb2, router_pb2_grpc

MODEL = "tiny"
KEY = "sk-parity"
MAX_MODEL_LEN = 512
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / MODEL
    make_tiny_checkpoint(path)
    return path


def _chat_proto() -> router_pb2.ChatMessages:
    return router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(**m) for m in CHAT], add_generation_prompt=True)


# (HTTP path, HTTP body, the same request over gRPC, expected temperature, expected max_tokens;
#  None: the room the context leaves after the prompt)
CASES = {
    "chat, nothing set": ("/v1/chat/completions", {"messages": CHAT},
                          router_pb2.GenerateRequest(chat=_chat_proto()), 1.0, None),
    "text, nothing set": ("/v1/completions", {"prompt": "hello"},
                          router_pb2.GenerateRequest(text="hello"), 1.0, 16),
    "token ids, nothing set": ("/v1/completions", {"prompt": [5, 6, 7]},
                               router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[5, 6, 7])), 1.0, 16),
    "chat, only max_tokens set": ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3},
                                  router_pb2.GenerateRequest(chat=_chat_proto(),
                                                             sampling=common_pb2.SamplingParams(max_tokens=3)), 1.0, 3),
    "text, only temperature set": ("/v1/completions", {"prompt": "hello", "temperature": 0.5},
                                   router_pb2.GenerateRequest(text="hello",
                                                              sampling=common_pb2.SamplingParams(temperature=0.5)),
                                   0.5, 16),
    "chat, greedy and max_tokens set": (
        "/v1/chat/completions", {"messages": CHAT, "temperature": 0, "max_tokens": 3},
        router_pb2.GenerateRequest(chat=_chat_proto(),
                                   sampling=common_pb2.SamplingParams(temperature=0, max_tokens=3)), 0.0, 3),
    "text, top_p and seed set": (  # values exact in float32, the wire type
        "/v1/completions", {"prompt": "hello", "temperature": 0.5, "top_p": 0.75, "seed": 0, "max_tokens": 4},
        router_pb2.GenerateRequest(text="hello", sampling=common_pb2.SamplingParams(
            temperature=0.5, top_p=0.75, seed=0, max_tokens=4)), 0.5, 4),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_unset_sampling_field_means_the_same_at_the_grpc_and_http_doors(model_dir, case):
    """It did not: gRPC read an omitted temperature as 0 (greedy) where HTTP reads 1.0, and
    an omitted max_tokens as the context limit where /v1/completions reads 16."""
    path, body, grpc_request, temperature, max_tokens = CASES[case]

    async def go():
        tokenizer = Tokenizer.from_dir(model_dir)
        fake = FakeDownstream(tokenizer)
        generator = Generator(tokenizer, model_limits(model_dir, tokenizer, [MODEL], max_model_len=MAX_MODEL_LEN),
                              fake)
        keys = KeyStore({KEY: "acme"})
        client = TestClient(TestServer(HttpApi(generator, keys, MODEL).app(1 << 20)))
        await client.start_server()
        server = GrpcServer("weft.v1.Router", "127.0.0.1", 0, rules=ROUTER_ERROR_RULES)
        add_router_to_server(RouterServicer(generator, keys, MODEL), server.server)
        port = await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        try:
            resp = await client.post(path, json={"model": MODEL, **body}, headers={"Authorization": f"Bearer {KEY}"})
            assert resp.status == 200, await resp.text()
            stub = router_pb2_grpc.RouterStub(channel)
            [c async for c in stub.Generate(grpc_request, metadata=(("authorization", f"Bearer {KEY}"),))]
            assert len(fake.requests) == 2
            over_http, over_grpc = fake.requests
            assert over_grpc.sampling == over_http.sampling
            assert over_grpc.sampling.temperature == temperature and over_grpc.sampling.top_p == (
                body.get("top_p", 1.0))
            room = MAX_MODEL_LEN - len(over_grpc.prompt_token_ids)
            assert over_grpc.sampling.max_tokens == (room if max_tokens is None else max_tokens)
        finally:
            await channel.close()
            await server.server.stop(0)
            await client.close()
    asyncio.run(go())


def _describe(address: str) -> tuple[list[str], str, str]:
    """What a reflection client (grpcurl's way) learns with no .proto in hand: the service
    names, and Generate's request type resolved to a full descriptor (its imports too)."""
    with grpc.insecure_channel(address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = list(database.get_services())
        pool = descriptor_pool.DescriptorPool(database)
        generate = pool.FindServiceByName("weft.v1.Router").methods_by_name["Generate"]
        sampling = generate.input_type.fields_by_name["sampling"].message_type
        return services, generate.input_type.full_name, sampling.full_name


def test_the_public_grpc_port_serves_reflection_of_the_router_api(model_dir, tmp_path):
    """grpcurl / Postman could not list or describe weft.v1.Router: no reflection service."""
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text(f"{KEY} acme\n")
    config = RouterConfig(model_dir=str(model_dir), grpc_port=0, http_port=0, keys_file=str(keys_file),
                          scheduler_address="127.0.0.1:1")

    async def go():
        app = RouterApp(config)  # the production wiring; nothing here generates
        await app.start()
        try:
            return await asyncio.to_thread(_describe, f"127.0.0.1:{app.grpc.port}")
        finally:
            await app.grpc.server.stop(0)
            await app.stop()
    services, request_type, sampling_type = asyncio.run(go())
    assert "weft.v1.Router" in services and "grpc.health.v1.Health" in services
    assert request_type == "weft.v1.GenerateRequest" and sampling_type == "weft.v1.SamplingParams"


@pytest.mark.parametrize("sampling, field", [
    (common_pb2.SamplingParams(max_tokens=0), "sampling.max_tokens"),
    (common_pb2.SamplingParams(top_p=0), "sampling.top_p"),
])
def test_a_sampling_field_set_to_zero_is_refused_naming_it_not_read_as_unset(model_dir, sampling, field):
    """As over HTTP (max_tokens 0, top_p 0 are 400): 0 read as "unset" hid a client's bug."""
    async def go():
        tokenizer = Tokenizer.from_dir(model_dir)
        generator = Generator(tokenizer, model_limits(model_dir, tokenizer, [MODEL], max_model_len=MAX_MODEL_LEN),
                              FakeDownstream(tokenizer))
        server = GrpcServer("weft.v1.Router", "127.0.0.1", 0, rules=ROUTER_ERROR_RULES)
        add_router_to_server(RouterServicer(generator, KeyStore({KEY: "acme"}), MODEL), server.server)
        port = await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        try:
            stub = router_pb2_grpc.RouterStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [c async for c in stub.Generate(router_pb2.GenerateRequest(text="hi", sampling=sampling),
                                                metadata=(("authorization", f"Bearer {KEY}"),))]
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith(f"{field}:")
        finally:
            await channel.close()
            await server.server.stop(0)
    asyncio.run(go())
