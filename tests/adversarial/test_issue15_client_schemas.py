"""Hostile structured output (issue 15): JSON schemas whose constraints the grammar engine
would drop. xgrammar compiles ``not``, ``if``/``then``, ``contains``, a multi-entry
``allOf``... as if the keyword were absent (or as "[]" only), so a request using one was
answered 200 with output that broke the schema the client sent. Each is now a 400 naming
the keyword's path; NaN / Infinity (which Python's json reads and JSON forbids) likewise."""
from __future__ import annotations

import json

import pytest
import xgrammar as xg
from xgrammar.testing import _is_grammar_accept_string

from tests.unit.router.test_http import model_dir  # noqa: F401  (fixture)
from tests.unit.router.agent_io_fakes import CHAT, one, post

DROPPED = [  # (schema, a value the schema forbids, the keyword's path under the field)
    ({"not": {}}, "57", "not"),
    ({"type": "integer", "not": {"type": "integer"}}, "3", "not"),
    ({"type": "array", "contains": {"type": "string"}}, "[]", "contains"),  # compiled to "[]" only
    ({"if": {"type": "integer"}, "then": {"minimum": 5}}, "1", "if"),
    ({"allOf": [{"type": "integer"}, {"type": "string"}]}, "1", "allOf"),
    ({"type": "object", "properties": {"a": {"not": {"type": "null"}}}}, '{"a": null}', "properties.a.not"),
    ({"$defs": {"d": {"type": "integer", "not": {"const": 1}}}, "$ref": "#/$defs/d"}, "1", "$defs.d.not"),
    ({"anyOf": [{"type": "string"}, {"type": "array", "items": {"not": {}}}]}, "[1]", "anyOf[1].items.not"),
]


@pytest.mark.parametrize("schema, forbidden, _path", DROPPED, ids=lambda v: str(v)[:40])
def test_xgrammar_accepts_what_these_schemas_forbid(schema, forbidden, _path):
    """Why they are refused: the compiled grammar lets the forbidden value through."""
    grammar = xg.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    assert _is_grammar_accept_string(grammar, forbidden)


@pytest.mark.parametrize("form", ["response_format", "guided_json", "guided_json_text", "structured_outputs"])
@pytest.mark.parametrize("schema, _forbidden, path", DROPPED, ids=lambda v: str(v)[:40])
def test_a_schema_keyword_the_grammar_would_drop_is_400_naming_its_path(model_dir, form, schema, _forbidden, path):  # noqa: F811
    extra, field = {
        "response_format": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
                            "response_format.json_schema.schema"),
        "guided_json": ({"guided_json": schema}, "guided_json"),
        "guided_json_text": ({"guided_json": json.dumps(schema)}, "guided_json"),
        "structured_outputs": ({"structured_outputs": {"json": schema}}, "structured_outputs.json"),
    }[form]
    status, body, fake, _ = one(model_dir, CHAT, extra)
    assert status == 400, body
    assert body["error"]["param"] == f"{field}.{path}", body
    assert fake.requests == []


@pytest.mark.parametrize("schema, field", [
    ({"anyOf": []}, "guided_json.anyOf"),  # compiled to the empty string: not JSON at all
    ({"oneOf": []}, "guided_json.oneOf"),
    ({"type": []}, "guided_json.type"),  # compiled to "any value"
])
def test_an_empty_alternative_list_is_400(model_dir, schema, field):  # noqa: F811
    status, body, fake, _ = one(model_dir, CHAT, {"guided_json": schema})
    assert status == 400 and body["error"]["param"] == field, body
    assert fake.requests == []


def test_keywords_as_data_or_property_names_are_not_refused(model_dir):  # noqa: F811
    schema = {"type": "object", "properties": {"not": {"type": "integer"}, "if": {"enum": [{"not": 1}]}},
              "required": ["not"], "default": {"allOf": [1, 2]}, "allOf": [{"type": "object"}]}
    status, body, fake, _ = one(model_dir, CHAT, {"guided_json": schema})
    assert status == 200, body
    assert fake.requests[0].sampling.grammar == ("json_schema", json.dumps(schema, separators=(",", ":")))


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_nan_or_infinity_inside_a_schema_is_400_naming_it_before_the_executor(model_dir, literal):  # noqa: F811
    raw = b'{"type": "number", "minimum": ' + literal + b"}"
    body = {**CHAT[1], "guided_json": raw.decode()}
    [(status, text)], fake, _ = post(model_dir, [(CHAT[0], body)])
    assert status == 400, text
    error = json.loads(text)["error"]
    assert error["param"] == "guided_json" and "NaN or Infinity" in error["message"]
    assert fake.requests == []


def _tool(parameters):
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_a_forced_tools_parameters_the_grammar_would_drop_are_400_naming_the_tool(model_dir, choice):  # noqa: F811
    params = {"type": "object", "properties": {"x": {"type": "integer", "not": {"const": 0}}}}
    extra = {"tools": [_tool({"type": "object"}), {**_tool(params), "function": {"name": "g", "parameters": params}}],
             "tool_choice": choice if choice == "required" else {"type": "function", "function": {"name": "g"}}}
    status, body, fake, _ = one(model_dir, CHAT, extra)
    assert status == 400, body
    assert body["error"]["param"] == "tools[1].function.parameters.properties.x.not", body
    assert fake.requests == []


def test_nan_in_a_forced_tools_parameters_is_400_naming_the_tool_not_tool_choice(model_dir):  # noqa: F811
    raw = (b'{"model": "mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, '
           b'"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": '
           b'{"type": "object", "properties": {"x": {"type": "number", "maximum": Infinity}}}}}]}')
    body = {**json.loads(raw), "model": CHAT[1]["model"]}
    [(status, text)], fake, _ = post(model_dir, [(CHAT[0], body)])
    assert status == 400, text
    assert json.loads(text)["error"]["param"] == "tools[0].function.parameters", text
    assert fake.requests == []


def test_the_grpc_door_refuses_a_forced_tools_dropped_keyword_naming_parameters_json():
    from weft.v1 import router_pb2

    from services.router.errors import InvalidRequestError
    from services.router.grpc_tools import tool_choice_from_proto, tools_from_proto, with_tool_grammar
    from services.router.schema import Sampling
    from services.router.tool_parsers import FORMATS

    request = router_pb2.GenerateRequest(
        chat=router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user", content="hi")]),
        tools=[router_pb2.ToolDefinition(name="f", parameters_json='{"type": "object", "properties": '
                                                                   '{"x": {"if": {"type": "integer"}}}}')],
        tool_choice=router_pb2.ToolChoice(mode=router_pb2.ToolChoice.MODE_REQUIRED))
    tools = tools_from_proto(request)
    with pytest.raises(InvalidRequestError) as err:
        with_tool_grammar(Sampling(), FORMATS["hermes"], tools, tool_choice_from_proto(request, tools), True)
    assert err.value.field == "tools[0].parameters_json.properties.x.if"


@pytest.mark.parametrize("extra, field", [({"ebnf": ""}, "ebnf"), ({"guided_regex": "  "}, "guided_regex"),
                                          ({"structured_outputs": {"grammar": " \n"}}, "structured_outputs.grammar")])
def test_a_blank_grammar_is_400_saying_it_is_empty_before_the_executor(model_dir, extra, field):  # noqa: F811
    status, body, fake, _ = one(model_dir, CHAT, extra)
    assert status == 400 and body["error"]["param"] == field, body
    assert "got an empty string" in body["error"]["message"] and fake.requests == []
