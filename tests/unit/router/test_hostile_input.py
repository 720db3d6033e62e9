"""Hostile input at the router's two doors (issue 12 §4-5): what used to be an HTTP 500,
a gRPC request HTTP would refuse, or a prompt that froze the event loop is now a 400 /
INVALID_ARGUMENT naming the field, through one shared validation path."""
from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from services.shared.prompt_budget import CharBudget, char_budget
from services.shared.tokenizer import Tokenizer
from tests.unit.router.test_grpc import KEY, _serve
from tests.unit.router.test_http import MODEL, _client, run
from weft.testing.tiny_model import make_tiny_checkpoint
from weft.v1 import common_pb2, router_pb2

CHAT = '{"model": "%s", "messages": [{"role": "user", "content": %%s}]%%s}' % MODEL


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / MODEL
    make_tiny_checkpoint(path)
    return path


@pytest.mark.parametrize("body, field", [
    (CHAT % ('"hi"', ', "max_tokens": ' + "9" * 5000), "max_tokens"),
    (CHAT % ('"hi"', ', "max_tokens": -' + "9" * 5000), "max_tokens"),
    (CHAT % ('"hi"', ', "top_k": 100000000000000000000'), "top_k"),
    (CHAT % ('"hi"', ', "top_k": 1e20'), "top_k"),
    (CHAT % ('"hi"', ', "seed": ' + "1" * 4400), "seed"),
    (CHAT % ('"a\\ud800b"', ""), "messages[0].content"),
    (CHAT % ('"a\\udc00b"', ""), "messages[0].content"),
    (CHAT % ('"hi"', ', "stop": ["x\\ud83d"]'), "stop[0]"),
    ('{"model": "%s", "prompt": %s}' % (MODEL, "[" * 100_000 + "]" * 100_000), "body"),
    ("[" * 100_000 + "]" * 100_000, "body"),
    ('{"a": ' * 100_000 + "1" + "}" * 100_000, "body"),
])
def test_hostile_json_is_400_naming_the_field_not_500(model_dir, body, field):
    async def go():
        client, _ = await _client(model_dir)
        try:
            path = "/v1/completions" if '"prompt"' in body else "/v1/chat/completions"
            resp = await client.post(path, data=body.encode(), headers={"Content-Type": "application/json"})
            err = await resp.json()
            assert resp.status == 400, err
            assert err["error"]["param"] == field, err
            ok = await client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert ok.status == 200
        finally:
            await client.close()
    run(go())


def test_valid_surrogate_pairs_and_ordinary_unicode_are_accepted(model_dir):
    async def go():
        client, fake = await _client(model_dir)
        try:
            body = CHAT % ('"smile \\ud83d\\ude00 caf\\u00e9"', ', "max_tokens": 2')
            resp = await client.post("/v1/chat/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
            assert resp.status == 200, await resp.text()
            assert len(fake.requests) == 1
        finally:
            await client.close()
    run(go())


@pytest.mark.parametrize("request_kwargs, field", [
    ({"text": "x", "session": common_pb2.SessionInfo(request_class=99)}, "session.request_class"),
    ({"text": "x", "session": common_pb2.SessionInfo(contract=common_pb2.Contract(fallback=99))},
     "session.contract.fallback"),
    ({"text": "x", "session": common_pb2.SessionInfo(contract=common_pb2.Contract(accepted_degrade_steps=[77]))},
     "session.contract.accepted_degrade_steps[0]"),
    ({"chat": router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user", content="hi"),
                                                router_pb2.ChatMessage(role="tool", content="12:00")])},
     "chat.messages[1].tool_call_id"),
    ({"chat": router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="wizard", content="hi")])},
     "chat.messages[0].role"),
    ({"text": "x", "request_id": "r" * 65}, "request_id"),
    ({"text": "x", "request_id": "x" * (4 << 20)}, "request_id"),
    ({"text": "x", "request_id": "a/b"}, "request_id"),
    ({"text": "x", "request_id": "new\nline"}, "request_id"),
    ({"text": "a" * 1_000_000}, "text"),
    ({"chat": router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user", content="a" * 1_000_000)])},
     "chat.messages"),
])
def test_grpc_refuses_what_http_refuses_naming_the_field(model_dir, request_kwargs, field):
    async def go():
        server, channel, stub, fake = await _serve(model_dir)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(router_pb2.GenerateRequest(**request_kwargs), metadata=KEY):
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith(f"{field}:"), err.value.details()
            assert len(err.value.details()) < 400  # names the size, never echoes a 4 MB id
            assert fake.requests == []
        finally:
            await channel.close()
            await server.server.stop(0)
    asyncio.run(go())


def test_grpc_well_formed_request_id_and_enums_still_pass(model_dir):
    async def go():
        server, channel, stub, fake = await _serve(model_dir)
        try:
            req = router_pb2.GenerateRequest(
                text="hi", request_id="job-1.a:b_c", sampling=common_pb2.SamplingParams(max_tokens=2),
                session=common_pb2.SessionInfo(request_class=common_pb2.REQUEST_CLASS_BATCH, contract=common_pb2.Contract(
                    fallback=common_pb2.FALLBACK_PATH_REROUTE, accepted_degrade_steps=[common_pb2.DEGRADE_STEP_KV_INT8])))
            chunks = [c async for c in stub.Generate(req, metadata=KEY)]
            assert chunks[-1].request_id == "job-1.a:b_c"  # the client sees its own id
            sent = fake.requests[0]
            assert sent.request_id == "acme/job-1.a:b_c"  # the mesh sees it scoped by tenant
            assert sent.session.request_class == "batch" and sent.session.contract.fallback == "reroute"
            assert sent.session.contract.accepted_degrade_steps == ("kv_int8",)
        finally:
            await channel.close()
            await server.server.stop(0)
    asyncio.run(go())


# -- the character pre-check ----------------------------------------------------------
def test_a_prompt_that_can_never_fit_is_refused_before_tokenizing(model_dir):
    async def go():
        client, fake = await _client(model_dir)  # max_model_len 512
        generator_tokenizer = Tokenizer.from_dir(model_dir)
        limit = generator_tokenizer.char_budget.max_chars(512, is_ascii=True)
        try:
            resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "a" * (limit + 1)})
            err = await resp.json()
            assert resp.status == 400
            assert err["error"]["param"] == "prompt"
            assert f"at most {limit} characters" in err["error"]["message"]
            assert "512" in err["error"]["message"]
            # Just under the bound it is tokenized (and refused by its token count instead).
            resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "a" * limit})
            err = await resp.json()
            assert resp.status == 400 and err["error"]["param"] == "prompt"
            assert "tokens exceed" in err["error"]["message"]
            assert fake.requests == []
        finally:
            await client.close()
    run(go())


def test_the_character_bound_is_sound_for_the_tiny_tokenizer(model_dir):
    """No text over the bound fits: the densest text (the longest vocabulary entry
    repeated) has exactly max_chars_per_token chars per token."""
    tok = Tokenizer.from_dir(model_dir)
    budget = tok.char_budget
    assert budget.max_chars_per_token is not None
    vocab = tok._backend.get_vocab(with_added_tokens=True)
    for text in ("a" * 5000, "hello world " * 500, "".join(sorted(vocab, key=len)[-50:]) * 20):
        text = text.replace("Ġ", " ")
        num_tokens = len(tok.encode(text))
        assert len(text) <= num_tokens * budget.max_chars_per_token * (1 if text.isascii() else budget.max_shrink)


@pytest.mark.parametrize("spec, expect_bound", [
    ({"normalizer": None, "pre_tokenizer": {"type": "ByteLevel"}, "model": {"type": "BPE"}}, True),
    ({"normalizer": {"type": "NFC"}, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "behavior": "Isolated"}, {"type": "ByteLevel"}]}, "model": {"type": "BPE"}}, True),
    ({"normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"}, {
        "type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}, "pre_tokenizer": None,
      "model": {"type": "BPE", "byte_fallback": True}}, True),
    ({"normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "model": {"type": "BPE", "unk_token": "<unk>"}},
     False),
    ({"normalizer": {"type": "Strip"}, "pre_tokenizer": {"type": "ByteLevel"}, "model": {"type": "BPE"}}, False),
    ({"normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": ""}, "pre_tokenizer": None,
      "model": {"type": "BPE", "byte_fallback": True}}, False),
    ({"normalizer": None, "pre_tokenizer": None, "model": {"type": "BPE", "unk_token": "<unk>", "fuse_unk": True}},
     False),
    ({"normalizer": None, "pre_tokenizer": {"type": "BertPreTokenizer"}, "model": {"type": "WordPiece"}}, False),
])
def test_char_budget_is_given_only_for_pipelines_that_cannot_drop_characters(spec, expect_bound):
    budget = char_budget(spec, ["a", "abcd", "<|im_start|>"])
    assert (budget.max_chars_per_token is not None) == expect_bound
    if expect_bound:
        assert budget.max_chars_per_token == len("<|im_start|>")
        assert budget.max_chars(100, is_ascii=True) <= budget.max_chars(100, is_ascii=False)
    else:
        assert budget.max_chars(100, is_ascii=True) is None


def test_nfc_composition_widens_the_bound_for_non_ascii_text_only():
    budget = CharBudget(10, max_shrink=4, ascii_shrink=1)
    assert budget.max_chars(100, is_ascii=True) == 1000
    assert budget.max_chars(100, is_ascii=False) == 4000


def test_hostile_json_module_names_the_surrogate_field():
    from services.router.errors import InvalidRequestError
    from services.router.json_body import parse_json_body

    with pytest.raises(InvalidRequestError) as err:
        parse_json_body(json.dumps({"tools": [{"function": {"name": "f\ud800"}}]}).encode())
    assert err.value.field == "tools[0].function.name"
    assert parse_json_body(b'{"a": "\\\\ud800"}') == {"a": "\\ud800"}  # an escaped backslash, not a surrogate
