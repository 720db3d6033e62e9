"""The one async prepare step (services/router/prepare.py): every prompt form becomes the
same kind of ``TokenRequest``, refusals name the door's field, large prompts are rendered
and encoded off the event loop, and the HTTP and gRPC doors prepare identical requests."""
from __future__ import annotations

import asyncio
import dataclasses
import threading

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.mesh.grpc_server import GrpcServer
from services.router.auth import KeyStore
from services.router.errors import InvalidRequestError
from services.router.generation import Generator, model_limits
from services.router.http_api import HttpApi
from services.router.prepare import (OFFLOAD_TOKENIZE_CHARS, ChatPrompt, RequestPreparer, TextPrompt, TokenIdsPrompt,
                                     completion_prompt)
from services.router.schema import Sampling, Session
from services.router.server import ROUTER_ERROR_RULES, RouterServicer
from services.router.validation import Limits
from services.shared.tokenizer import Tokenizer
from tests.unit.router.test_http import MODEL, FakeDownstream
from weft.testing.tiny_model import make_tiny_checkpoint
from weft.v1 import common_pb2, router_pb2, router_pb2_grpc

HI = ({"role": "user", "content": "hi"},)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / MODEL
    make_tiny_checkpoint(path)
    return path


def _preparer(model_dir, max_model_len: int = 512) -> RequestPreparer:
    tokenizer = Tokenizer.from_dir(model_dir)
    return RequestPreparer(tokenizer, model_limits(model_dir, tokenizer, [MODEL], max_model_len))


def test_every_prompt_form_becomes_a_token_request_scoped_by_tenant(model_dir):
    prep = _preparer(model_dir)
    tok = prep.tokenizer
    sampling = Sampling(max_tokens=None, temperature=0.0)

    async def go():
        text = await prep.prepare(TextPrompt("hello"), sampling, "acme", Session(), "r1")
        ids = await prep.prepare(TokenIdsPrompt((5, 6, 7), "token_ids"), sampling, "acme", Session(), "r2")
        chat = await prep.prepare(ChatPrompt(HI), sampling, "acme", Session(), "r3")
        tools = await prep.prepare(ChatPrompt(HI, ({"type": "function", "function": {"name": "f"}},)), sampling,
                                   "acme", Session(), "r4")
        return text, ids, chat, tools

    text, ids, chat, tools = asyncio.run(go())
    assert text.prompt_token_ids == tuple(tok.encode("hello"))
    assert ids.prompt_token_ids == (5, 6, 7)
    rendered = tok.apply_chat_template(list(HI), tools=None, add_generation_prompt=True)
    assert chat.prompt_token_ids == tuple(tok.encode(rendered, add_special_tokens=False))
    assert [r.request_id for r in (text, ids, chat)] == ["acme/r1", "acme/r2", "acme/r3"]
    assert text.tenant == "acme" and text.sampling.max_tokens == 512 - len(text.prompt_token_ids)
    assert chat.session.request_class == "interactive" and tools.session.request_class == "agentic"
    assert completion_prompt("a", "prompt[0]") == TextPrompt("a", "prompt[0]")
    assert completion_prompt((1, 2), "prompt[1]") == TokenIdsPrompt((1, 2), "prompt[1]")


@pytest.mark.parametrize("prompt, field", [
    (TokenIdsPrompt((1, 99999), "token_ids"), "token_ids[1]"),
    (TextPrompt("word " * 20_000, "text"), "text"),
    (ChatPrompt(({"role": "user", "content": "word " * 20_000},), field="chat.messages"), "chat.messages"),
    (TokenIdsPrompt((), "prompt[2]"), "prompt[2]"),
])
def test_a_refused_prompt_names_its_doors_field(model_dir, prompt, field):
    prep = _preparer(model_dir, max_model_len=64)
    with pytest.raises(InvalidRequestError) as err:
        asyncio.run(prep.prepare(prompt, Sampling(max_tokens=4), "acme", Session(), "r"))
    assert err.value.field == field


def test_a_large_conversation_is_rendered_and_encoded_off_the_event_loop(model_dir):
    tokenizer = Tokenizer.from_dir(model_dir)
    limits = Limits(served_models=(MODEL,), max_model_len=1 << 20, vocab_size=tokenizer.vocab_size)
    prep = RequestPreparer(tokenizer, limits)
    threads: dict[str, int] = {}
    render, encode_bounded = tokenizer.apply_chat_template, tokenizer.encode_bounded

    def recording(name, fn):
        def call(*args, **kwargs):
            threads[name] = threading.get_ident()
            return fn(*args, **kwargs)
        return call

    tokenizer.apply_chat_template = recording("render", render)
    tokenizer.encode_bounded = recording("encode", encode_bounded)
    big = ChatPrompt(({"role": "user", "content": "ab " * OFFLOAD_TOKENIZE_CHARS},), field="chat.messages")

    async def go():
        loop_thread = threading.get_ident()
        request = await prep.prepare(big, Sampling(max_tokens=4), "acme", Session(), "r")
        return loop_thread, request

    loop_thread, request = asyncio.run(go())
    assert set(threads) == {"render", "encode"}
    assert loop_thread not in threads.values()
    assert len(request.prompt_token_ids) > 0


def test_the_http_and_grpc_doors_prepare_the_same_request_for_the_same_conversation(model_dir):
    tokenizer = Tokenizer.from_dir(model_dir)
    limits = model_limits(model_dir, tokenizer, [MODEL], max_model_len=512)

    async def go():
        http_fake, grpc_fake = FakeDownstream(tokenizer), FakeDownstream(tokenizer)
        client = TestClient(TestServer(HttpApi(Generator(tokenizer, limits, http_fake), KeyStore({"sk-1": "acme"}),
                                               MODEL).app(1 << 20)))
        await client.start_server()
        server = GrpcServer("weft.v1.Router", "127.0.0.1", 0, rules=ROUTER_ERROR_RULES)
        router_pb2_grpc.add_RouterServicer_to_server(
            RouterServicer(Generator(tokenizer, limits, grpc_fake), KeyStore({"sk-1": "acme"}), MODEL), server.server)
        port = await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        try:
            resp = await client.post("/v1/chat/completions", headers={"Authorization": "Bearer sk-1"},
                                     json={"model": MODEL, "messages": list(HI), "max_tokens": 3, "temperature": 0})
            assert resp.status == 200
            stub = router_pb2_grpc.RouterStub(channel)
            req = router_pb2.GenerateRequest(
                chat=router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user", content="hi")],
                                             add_generation_prompt=True),
                sampling=common_pb2.SamplingParams(max_tokens=3, temperature=0))
            assert [c async for c in stub.Generate(req, metadata=(("authorization", "Bearer sk-1"),))]
        finally:
            await channel.close()
            await server.server.stop(0)
            await client.close()
        return http_fake.requests[0], grpc_fake.requests[0]

    via_http, via_grpc = asyncio.run(go())
    same = lambda r: dataclasses.replace(r, request_id="", deadline_unix_ms=0)  # noqa: E731
    assert via_http.request_id.startswith("acme/") and via_grpc.request_id.startswith("acme/")
    assert same(via_http) == same(via_grpc)


@pytest.mark.parametrize("shaping", [{"grammar": ("json_object", "")}, {"logit_bias": ((5, -100.0),)},
                                     {"min_p": 0.1}, {"repetition_penalty": 1.2}, {"presence_penalty": 0.5},
                                     {"frequency_penalty": 0.5}, {"prompt_logprobs": 0}])
def test_a_request_that_reshapes_greedy_output_is_never_answered_from_the_semantic_cache(shaping):
    """The semantic cache keys on prompt and length limits: a grammar, bias or penalty would
    get (or leave) an answer written without it."""
    preparer = RequestPreparer(None, Limits(served_models=(MODEL,), max_model_len=64, vocab_size=100))
    prepare = lambda s: preparer.token_request([1, 2, 3], s, "t", Session(), "prompt", "r")  # noqa: E731
    assert prepare(Sampling(max_tokens=4, temperature=0.0, semantic_cache=True)).sampling.semantic_cache
    assert not prepare(Sampling(max_tokens=4, temperature=0.0, semantic_cache=True, **shaping)).sampling.semantic_cache
