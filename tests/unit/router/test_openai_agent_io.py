"""Issue 15 at the OpenAI HTTP door, against an in-process fake downstream (no processes,
no model): structured output, sampler fields, tools, embeddings. Logprobs, echo and n
completions: ``test_openai_logprobs_n.py``."""
from __future__ import annotations

import asyncio
import json

import grpc
import pytest
import xgrammar as xg
from xgrammar.testing import _is_grammar_accept_string

from services.router.errors import InvalidRequestError
from services.router.scheduler_client import domain_error
from services.router.structured_output import MAX_GRAMMAR_CHARS
from services.shared.tokenizer import Tokenizer
from tests.unit.router.agent_io_fakes import CHAT, COMPLETION, REPLY, FakeEmbeddings, client_for, one, post
from tests.unit.router.test_http import MODEL, model_dir  # noqa: F401  (fixture)


# -- structured output ---------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.mark.parametrize("endpoint, extra, grammar", [
    (CHAT, {"response_format": {"type": "json_object"}}, ("json_object", "")),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA, "strict": True}}},
     ("json_schema", json.dumps(SCHEMA, separators=(",", ":")))),
    (COMPLETION, {"response_format": {"type": "json_object"}}, ("json_object", "")),
    (CHAT, {"guided_json": SCHEMA}, ("json_schema", json.dumps(SCHEMA, separators=(",", ":")))),
    (COMPLETION, {"guided_json": json.dumps(SCHEMA)}, ("json_schema", json.dumps(SCHEMA, separators=(",", ":")))),
    (CHAT, {"guided_regex": "[a-z]+"}, ("regex", "[a-z]+")),
    (COMPLETION, {"guided_grammar": 'root ::= "a"'}, ("ebnf", 'root ::= "a"')),
    (CHAT, {"structured_outputs": {"regex": "x+"}}, ("regex", "x+")),
    (CHAT, {"regex": "y+"}, ("regex", "y+")), (CHAT, {"ebnf": 'root ::= "b"'}, ("ebnf", 'root ::= "b"')),
    (COMPLETION, {"json_schema": SCHEMA}, ("json_schema", json.dumps(SCHEMA, separators=(",", ":")))),
], ids=lambda v: str(v)[:40])
def test_each_structured_output_form_reaches_the_executor_as_its_grammar(model_dir, endpoint, extra, grammar):  # noqa: F811
    status, body, fake, _ = one(model_dir, endpoint, extra)
    assert status == 200, body
    assert fake.requests[0].sampling.grammar == grammar


def test_guided_choice_is_a_regex_that_xgrammar_compiles_and_that_accepts_exactly_the_choices(model_dir):  # noqa: F811
    choices = ["yes", "no (maybe)", "a.b|c", 'q"uote', "new\nline"]
    status, body, fake, _ = one(model_dir, CHAT, {"guided_choice": choices})
    assert status == 200, body
    kind, regex = fake.requests[0].sampling.grammar
    grammar = xg.Grammar.from_regex(regex)
    assert kind == "regex" and all(_is_grammar_accept_string(grammar, c) for c in choices)
    assert not any(_is_grammar_accept_string(grammar, w) for w in ("ye", "no", "aXb|c", "yesno", "a.b"))


@pytest.mark.parametrize("extra, field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "c"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"guided_json": "{not json"}, "guided_json"), ({"guided_regex": ""}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"), ({"guided_choice": ["a", 3]}, "guided_choice[1]"),
    ({"guided_choice": ["a"] * 257}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs"),
    ({"structured_outputs": {"xml": "a"}}, "structured_outputs.xml"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),  # two forms
    ({"guided_regex": "a" * (MAX_GRAMMAR_CHARS + 1)}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(4000)}}}}},
     "response_format.json_schema.schema"),  # a huge schema
], ids=lambda v: str(v)[:50])
def test_a_bad_structured_output_is_400_naming_the_field_and_nothing_goes_downstream(model_dir, extra, field):  # noqa: F811
    status, body, fake, _ = one(model_dir, CHAT, extra)
    assert status == 400, body
    assert body["error"]["param"] == field, body
    assert fake.requests == []


def test_scheduler_client_maps_the_executors_grammar_refusal_to_a_field_error():
    err = grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(),
                               details="grammar.json_schema: unsupported keyword 'foo'")
    exc = domain_error(err)
    assert isinstance(exc, InvalidRequestError) and exc.field == "grammar.json_schema"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("extra, field", [({"response_format": {"type": "json_schema", "json_schema": {
    "name": "c", "schema": SCHEMA}}}, "response_format"), ({"guided_regex": "(("}, "guided_regex")])
def test_a_grammar_the_executor_cannot_compile_is_400_naming_the_clients_field(model_dir, extra, field, stream):  # noqa: F811
    def setup(fake):
        fake.fail = InvalidRequestError("grammar.json_schema", "unsupported keyword 'foo'")
    status, body, _, _ = one(model_dir, CHAT, {**extra, "stream": stream}, setup)
    assert status == 400, body
    assert body["error"]["param"] == field and "unsupported keyword 'foo'" in body["error"]["message"]


def test_other_executor_refusals_keep_their_field(model_dir):  # noqa: F811
    def setup(fake):
        fake.fail = InvalidRequestError("sampling.logit_bias", "bad")
    status, body, _, _ = one(model_dir, CHAT, {"response_format": {"type": "json_object"}}, setup)
    assert status == 400 and body["error"]["param"] == "sampling.logit_bias"



# -- sampler fields --------------------------------------------------------------------
def test_sampler_fields_reach_the_downstream_request(model_dir):  # noqa: F811
    status, body, fake, _ = one(model_dir, CHAT, {"logit_bias": {"17": -100, "5": 2.5}, "min_p": 0.1,
                                                   "repetition_penalty": 1.2, "presence_penalty": 0.5,
                                                   "frequency_penalty": -0.5})
    assert status == 200, body
    s = fake.requests[0].sampling
    assert s.logit_bias == ((5, 2.5), (17, -100.0))
    assert (s.min_p, s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (0.1, 1.2, 0.5, -0.5)


@pytest.mark.parametrize("extra, field", [
    ({"logit_bias": {str(i): 1 for i in range(10**5)}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias.999999"), ({"logit_bias": {"x": 1}}, "logit_bias.x"),
    ({"logit_bias": {"-1": 1}}, "logit_bias.-1"), ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"logit_bias": {"5": "1"}}, "logit_bias.5"), ({"logit_bias": [1]}, "logit_bias"),
    ({"min_p": 1.5}, "min_p"), ({"min_p": -0.1}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": True}, "repetition_penalty"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
], ids=lambda v: str(v)[:40])
def test_bad_sampler_fields_are_400_naming_the_field(model_dir, extra, field):  # noqa: F811
    status, body, fake, _ = one(model_dir, CHAT, extra)
    assert status == 400 and body["error"]["param"] == field, body
    assert fake.requests == []



# -- tools -----------------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


def test_parallel_tool_calls_false_reaches_the_formats_grammar(model_dir):  # noqa: F811
    results, fake, _ = post(model_dir, [(CHAT[0], {**CHAT[1], "tools": TOOLS, "tool_choice": "required",
                                                   "parallel_tool_calls": p}) for p in (True, False)])
    assert [s for s, _ in results] == [200, 200]
    parallel, single = (r.sampling.grammar for r in fake.requests)
    assert parallel[0] == single[0] == "structural_tag" and parallel != single


def test_tool_choice_none_forbids_the_call_marker_and_parses_nothing(model_dir):  # noqa: F811
    status, body, fake, _ = one(model_dir, CHAT, {"tools": TOOLS, "tool_choice": "none"})
    kind, text = fake.requests[0].sampling.grammar
    assert status == 200 and kind == "structural_tag" and json.loads(text)["format"]["type"] == "any_text"
    assert body["choices"][0]["message"]["content"] == REPLY



CUT_CALLS = '<tool_call>[{"name": "get_time", "arguments": {}}, {"name": "get_ti'


@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_cut_by_max_tokens_keeps_its_complete_calls_and_says_length(model_dir, stream):  # noqa: F811
    def setup(fake):
        fake.reply = CUT_CALLS

    cut = len(Tokenizer.from_dir(model_dir).encode(CUT_CALLS, add_special_tokens=False))
    status, body, _, _ = one(model_dir, CHAT, {"tools": TOOLS, "tool_choice": "required", "stream": stream,
                                                "max_tokens": cut}, setup)
    assert status == 200
    if stream:
        reasons = [c["choices"][0]["finish_reason"] for c in body if c.get("choices") and c["choices"][0]["finish_reason"]]
        names = [tc["function"]["name"] for c in body if c.get("choices")
                 for tc in c["choices"][0]["delta"].get("tool_calls") or () if "function" in tc and tc["function"].get("name")]
        assert reasons == ["length"] and names == ["get_time"]
    else:
        choice = body["choices"][0]
        assert choice["finish_reason"] == "length"
        assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_time"]


# -- embeddings ------------------------------------------------------------------------
def test_embeddings_route_reaches_the_handler_and_its_model_is_listed(model_dir):  # noqa: F811
    emb = FakeEmbeddings()

    async def go():
        client, _, _ = await client_for(model_dir, emb)
        try:
            resp = await client.post("/v1/embeddings", json={"model": "mini", "input": "x"})
            assert resp.status == 200
            models = await (await client.get("/v1/models")).json()
            assert [m["id"] for m in models["data"]] == [MODEL, "mini"]
        finally:
            await client.close()
    asyncio.run(go())
    assert [body for body, _ in emb.calls] == [{"model": "mini", "input": "x"}]


def test_embeddings_without_an_embedding_model_is_404(model_dir):  # noqa: F811
    [(status, text)], _, _ = post(model_dir, [("/v1/embeddings", {"model": "mini", "input": "x"})])
    assert status == 404 and json.loads(text)["error"]["code"] == "model_not_found"
