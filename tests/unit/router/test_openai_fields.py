"""No OpenAI field is parsed and dropped (issue 15, first slice): a field that would change
the output is honoured or refused with a 400 naming it, before anything goes downstream;
fields without effect on the output are accepted and change nothing; ``GET
/v1/models/{id}`` answers one served model's card. Against a fake downstream (no
processes, no model)."""
from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.router.auth import KeyStore
from services.router.generation import Generator, model_limits
from services.router.http_api import HttpApi
from services.router.field_gaps import CHAT_FIELD_GAPS, COMPLETION_FIELD_GAPS
from services.shared.tokenizer import Tokenizer
from tests.unit.router.test_http import MODEL, FakeDownstream, model_dir  # noqa: F401  (fixture)

KEY = {"Authorization": "Bearer sk-fields"}
DOCS = Path(__file__).resolve().parents[3] / "docs" / "openai.md"
CHAT = ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
COMPLETION = ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3})
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
# A value each refused field is sent with: what a client asking for that behaviour sends.
ACTIVE = {
    "allowed_token_ids": [1, 2],
    "typical_p": 0.9, "bad_words": ["no"],
    "logits_processors": ["my.module:Proc"], "use_beam_search": True, "length_penalty": 0.8,
    "include_stop_str_in_output": True, "skip_special_tokens": False, "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 8, "prompt_logprobs": 1, "return_tokens_as_token_ids": True,
    "parallel_tool_calls": False, "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "function_call": "auto", "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
    "web_search_options": {}, "reasoning_effort": "low", "verbosity": "low", "echo": True,
    "add_generation_prompt": False, "continue_final_message": True, "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"enable_thinking": False}, "documents": [{"title": "t", "text": "x"}],
}
ACTIVE_ADD_SPECIAL_TOKENS = {"/v1/chat/completions": True, "/v1/completions": False}  # the other one's default
REFUSED = (
    [(CHAT, name, ACTIVE_ADD_SPECIAL_TOKENS[CHAT[0]] if name == "add_special_tokens" else ACTIVE[name])
     for name in CHAT_FIELD_GAPS]
    + [(COMPLETION, name, ACTIVE_ADD_SPECIAL_TOKENS[COMPLETION[0]] if name == "add_special_tokens" else ACTIVE[name])
       for name in COMPLETION_FIELD_GAPS]
    + [(CHAT, "best_of", 2), (COMPLETION, "best_of", 3),  # only best_of == n: completions are not ranked
       (CHAT, "guided_whitespace_pattern", " *"), (COMPLETION, "guided_decoding_backend", "outlines")]
)
# Values meaning today's behaviour: accepted, and the request goes downstream unchanged.
DEFAULTS = ([(CHAT, name, gap.default) for name, gap in CHAT_FIELD_GAPS.items() if gap.default is not None]
            + [(COMPLETION, name, gap.default) for name, gap in COMPLETION_FIELD_GAPS.items()
               if gap.default is not None]
            + [(CHAT, "repetition_penalty", 1.0), (CHAT, "best_of", 1.0), (CHAT, "guided_json", None),
               (CHAT, "response_format", {"type": "text"}), (COMPLETION, "logit_bias", {}), (CHAT, "min_p", 0),
               (CHAT, "presence_penalty", 0), (COMPLETION, "n", 1), (CHAT, "logprobs", False),
               (COMPLETION, "echo", False), (CHAT, "guided_decoding_backend", "xgrammar")])
NO_EFFECT = {"user": "u-1", "metadata": {"k": "v"}, "store": True, "service_tier": "auto", "prompt_cache_key": "k",
             "safety_identifier": "s", "prediction": {"type": "content", "content": "Hello"},
             "stream_options": {"include_usage": False, "include_obfuscation": False}}


async def _client(model_dir, model: str = MODEL, keys: dict | None = None):  # noqa: F811
    tokenizer = Tokenizer.from_dir(model_dir)
    fake = FakeDownstream(tokenizer)
    limits = model_limits(model_dir, tokenizer, [model], max_model_len=512)
    api = HttpApi(Generator(tokenizer, limits, fake), KeyStore(keys or {"sk-fields": "acme"}), model)
    client = TestClient(TestServer(api.app(1 << 20)))
    await client.start_server()
    return client, fake


def _post_all(model_dir, cases: list[tuple[str, dict]]) -> tuple[list[tuple[int, dict]], FakeDownstream]:  # noqa: F811
    async def go():
        client, fake = await _client(model_dir)
        try:
            out = []
            for path, body in cases:
                resp = await client.post(path, json=body, headers=KEY)
                out.append((resp.status, await resp.json()))
            return out, fake
        finally:
            await client.close()
    return asyncio.run(go())


def _ids(cases) -> list[str]:
    return [f"{'chat' if path is CHAT else 'completions'}-{field}-{value!r}"[:60] for path, field, value in cases]


@pytest.mark.parametrize("endpoint, field, value", REFUSED, ids=_ids(REFUSED))
def test_a_field_that_would_change_the_output_is_400_naming_it_and_nothing_goes_downstream(
        model_dir, endpoint, field, value):  # noqa: F811
    path, base = endpoint
    [(status, body)], fake = _post_all(model_dir, [(path, {**base, field: value})])
    assert status == 400, body
    assert body["error"]["param"] == field
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith(f"{field}: ")
    assert "not supported" in body["error"]["message"]
    assert fake.requests == []


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_forced_tool_call_goes_downstream_as_the_formats_structural_tag(model_dir, tool_choice):  # noqa: F811
    path, base = CHAT
    [(status, body)], fake = _post_all(model_dir, [(path, {**base, "tools": TOOLS, "tool_choice": tool_choice})])
    assert status == 200, body
    kind, text = fake.requests[0].sampling.grammar
    assert kind == "structural_tag" and "get_time" in text


def test_a_forced_tool_call_beside_response_format_is_400_naming_tool_choice(model_dir):  # noqa: F811
    path, base = CHAT
    [(status, body)], fake = _post_all(model_dir, [(path, {**base, "tools": TOOLS, "tool_choice": "required",
                                                           "response_format": {"type": "json_object"}})])
    assert status == 400 and body["error"]["param"] == "tool_choice", body
    assert fake.requests == []


def test_a_strict_tool_is_400_naming_its_strict_flag_where_no_grammar_enforces_it(model_dir):  # noqa: F811
    path, base = CHAT
    tools = [TOOLS[0], {"type": "function", "function": {"name": "f", "strict": True, "parameters": {}}}]
    # response_format wins over tool_choice "auto": nothing enforces the tool's schema then
    [(status, body)], _ = _post_all(model_dir, [(path, {**base, "tools": tools,
                                                        "response_format": {"type": "json_object"}})])
    assert status == 400, body
    assert body["error"]["param"] == "tools[1].function.strict"


@pytest.mark.parametrize("endpoint, field, value", DEFAULTS, ids=_ids(DEFAULTS))
def test_the_value_meaning_todays_behaviour_is_accepted_and_changes_nothing_downstream(
        model_dir, endpoint, field, value):  # noqa: F811
    path, base = endpoint
    results, fake = _post_all(model_dir, [(path, base), (path, {**base, field: value})])
    assert [status for status, _ in results] == [200, 200], results
    bare, with_field = fake.requests
    assert (with_field.prompt_token_ids, with_field.sampling) == (bare.prompt_token_ids, bare.sampling)


def test_tool_choice_auto_and_none_and_parallel_tool_calls_true_are_served(model_dir):  # noqa: F811
    path, base = CHAT
    cases = [(path, {**base, "tools": TOOLS, "tool_choice": c, "parallel_tool_calls": True}) for c in ("auto", "none")]
    cases.append((path, {**base, "tools": [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": False}}]}))
    results, _ = _post_all(model_dir, cases)
    assert [status for status, _ in results] == [200, 200, 200], results


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETION], ids=["chat", "completions"])
def test_fields_without_effect_on_the_output_are_accepted_and_change_nothing(model_dir, endpoint):  # noqa: F811
    path, base = endpoint
    results, fake = _post_all(model_dir, [(path, base), (path, {**base, **NO_EFFECT})])
    assert [status for status, _ in results] == [200, 200], results
    assert results[0][1]["choices"][0] == results[1][1]["choices"][0]
    bare, with_fields = fake.requests
    assert (with_fields.prompt_token_ids, with_fields.sampling) == (bare.prompt_token_ids, bare.sampling)


@pytest.mark.parametrize("model, path", [(MODEL, f"/v1/models/{MODEL}"), ("org/name", "/v1/models/org/name"),
                                         ("org/name", "/v1/models/org%2Fname")])
def test_get_model_by_id_returns_its_card_as_listed(model_dir, model, path):  # noqa: F811
    async def go():
        client, _ = await _client(model_dir, model=model)
        try:
            listed = await (await client.get("/v1/models", headers=KEY)).json()
            resp = await client.get(path, headers=KEY)
            assert resp.status == 200
            assert await resp.json() == listed["data"][0]
        finally:
            await client.close()
    asyncio.run(go())


def test_get_an_unserved_model_is_404_naming_the_id_in_openais_error_shape(model_dir):  # noqa: F811
    async def go():
        client, _ = await _client(model_dir)
        try:
            resp = await client.get("/v1/models/gpt-4o", headers=KEY)
            body = await resp.json()
            assert resp.status == 404
            assert set(body["error"]) == {"message", "type", "param", "code"}
            assert "'gpt-4o'" in body["error"]["message"]
            assert (body["error"]["param"], body["error"]["code"]) == ("model", "model_not_found")
        finally:
            await client.close()
    asyncio.run(go())


def test_get_model_by_id_needs_a_key_like_the_list(model_dir):  # noqa: F811
    async def go():
        client, _ = await _client(model_dir)
        try:
            for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
                for path in (f"/v1/models/{MODEL}", "/v1/models/gpt-4o"):  # no probing which ids exist
                    resp = await client.get(path, headers=headers)
                    assert resp.status == 401, (path, resp.status)
        finally:
            await client.close()
    asyncio.run(go())


def _docs_rows() -> dict[str, list[str]]:
    """``docs/openai.md`` table rows: field -> [chat column, completions column, notes]."""
    rows = {}
    for line in DOCS.read_text().splitlines():
        m = re.match(r"\|\s*`([a-z_]+)`\s*\|(.*)\|\s*$", line)
        if m:
            rows[m.group(1)] = [cell.strip() for cell in m.group(2).split("|")]
    return rows


def test_the_docs_table_marks_every_refused_field_as_400_on_its_endpoint():
    rows = _docs_rows()
    for column, gaps in ((0, CHAT_FIELD_GAPS), (1, COMPLETION_FIELD_GAPS)):
        for name in gaps:
            assert name in rows, name
            assert rows[name][column].startswith("400"), (name, rows[name])
    for name in set(NO_EFFECT) - {"stream_options"}:  # include_usage is supported
        assert rows[name][0].startswith("no effect"), (name, rows[name])
