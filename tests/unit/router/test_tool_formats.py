"""The tool-call formats' parsers (whole text and streamed), their selection from a chat
template or by name, and the validation of ``tools`` / ``tool_choice``."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from services.router.chat_messages import parse_tool_choice, parse_tool_choice_spec, parse_tools
from services.router.errors import InvalidRequestError
from services.router.tool_parsers import (
    FORMATS, ContentDelta, ToolCallArgsDelta, ToolCallStart, ToolChoice, collect, select_format,
)
from weft.models.chat_templates import SMOLLM2_TOOLS_TEMPLATE

# Per format: a reply with text the format allows around calls, and (content, [(name, args)]).
REPLIES = {
    "hermes": ('Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
               '<tool_call>{"name": "g", "arguments": {}}</tool_call>',
               "Sure. ", [("f", {"a": 1}), ("g", {})]),
    "smollm2": ('<tool_call>[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]</tool_call>',
                None, [("f", {"a": 1}), ("g", {})]),
    "llama3_json": ('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
                    None, [("f", {"a": 1}), ("g", {})]),
    "mistral": ('Calling. [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]',
                "Calling. ", [("f", {"a": 1}), ("g", {})]),
    "pythonic": ('[f(a=1), g(s="x", l=[1, 2.5], d={"k": None}, b=True)]',
                 None, [("f", {"a": 1}), ("g", {"s": "x", "l": [1, 2.5], "d": {"k": None}, "b": True})]),
}


def _calls(calls) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("fmt", sorted(REPLIES))
def test_each_format_parses_its_reply_into_calls_and_keeps_the_text(fmt):
    text, content, calls = REPLIES[fmt]
    got_content, got_calls = FORMATS[fmt].parse(text)
    assert got_content == content and _calls(got_calls) == calls


def _stream(fmt: str, pieces: list[str]):
    parser = FORMATS[fmt].stream_parser()
    return [e for p in pieces for e in parser.feed(p)] + parser.flush()


@pytest.mark.parametrize("fmt", sorted(REPLIES))
def test_streaming_char_by_char_gives_what_the_whole_text_gives(fmt):
    text, content, calls = REPLIES[fmt]
    events = _stream(fmt, list(text))
    got_content, got_calls = collect(events)
    assert got_content == content and _calls(got_calls) == calls
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert [s.index for s in starts] == list(range(len(calls)))
    for s in starts:  # a call's first event is its start; its arguments come after it
        first = next(i for i, e in enumerate(events) if getattr(e, "index", None) == s.index)
        assert events[first] is s
        assert any(isinstance(e, ToolCallArgsDelta) and e.index == s.index for e in events[first:])


@given(st.lists(st.integers(1, 7), max_size=40))
@settings(max_examples=60, deadline=None)
def test_how_the_text_is_split_does_not_change_the_result(cuts):
    for fmt, (text, content, calls) in REPLIES.items():
        pieces, rest = [], text
        for c in cuts:
            pieces.append(rest[:c])
            rest = rest[c:]
        got_content, got_calls = collect(_stream(fmt, pieces + [rest]))
        assert (got_content, _calls(got_calls)) == (content, calls), fmt


@pytest.mark.parametrize("fmt, text", [
    ("hermes", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),  # arguments not an object
    ("smollm2", '<tool_call>[{"name": "f"}, "oops"]</tool_call>'),
    ("llama3_json", '{"answer": 42}'),  # JSON, but not a call
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}} and then text'),
    ("mistral", "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}"),  # cut off
    ("pythonic", '[__import__("os").system("rm -rf /")]'),  # not a plain call: never evaluated
    ("pythonic", "[f(1, 2)]"),  # positional arguments
    ("pythonic", "[f(a=x)]"),  # not a literal
    ("pythonic", "[f(a={1, 2})]"),  # a literal JSON cannot carry
    ("pythonic", "[1, 2, 3]"),
])
def test_a_malformed_call_comes_back_as_content_unchanged(fmt, text):
    assert FORMATS[fmt].parse(text) == (text, [])
    assert collect(_stream(fmt, list(text))) == (text, [])


def test_plain_text_streams_through_without_waiting_for_the_end():
    for fmt in ("llama3_json", "pythonic"):  # calls only at the start: text is text at once
        assert _stream(fmt, ["Hello", " there"])[:2] == [ContentDelta("Hello"), ContentDelta(" there")]
    parser = FORMATS["mistral"].stream_parser()
    assert parser.feed("Hi [TOOL_") == [ContentDelta("Hi ")]  # a possible marker is held back
    assert parser.feed("x") == [ContentDelta("[TOOL_x")]


@pytest.mark.parametrize("text, content", [
    ('[{"name": "f", "arguments": {"a": 1}}]', None),  # the [TOOL_CALLS] control token decoded away
    ('[1] says so. [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]', "[1] says so. "),
])
def test_mistral_calls_are_found_without_the_marker_at_the_start_and_after_bracketed_text(text, content):
    for got in (FORMATS["mistral"].parse(text), collect(_stream("mistral", list(text)))):
        assert got[0] == content and _calls(got[1]) == [("f", {"a": 1})]


def test_mistral_call_ids_are_nine_alphanumerics():
    _, calls = FORMATS["mistral"].parse(REPLIES["mistral"][0])
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls) and calls[0].id != calls[1].id


MISTRAL_TEMPLATE = "{%- if message.tool_calls %}[TOOL_CALLS][{%- for tool in message.tool_calls %}"
LLAMA31_TEMPLATE = ('{{- "<|python_tag|>" + tool_call.arguments.code }}... Respond in the format '
                    '{"name": function name, "parameters": dictionary of argument name and its value}.')
PYTHONIC_TEMPLATE = "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]"
QWEN_TEMPLATE = "<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call>"


@pytest.mark.parametrize("template, name", [
    (MISTRAL_TEMPLATE, "mistral"), (LLAMA31_TEMPLATE, "llama3_json"), (PYTHONIC_TEMPLATE, "pythonic"),
    (QWEN_TEMPLATE, "hermes"), (SMOLLM2_TOOLS_TEMPLATE, "smollm2"), ("{{ messages }}", "hermes"), (None, "hermes"),
])
def test_the_format_is_recognised_from_the_chat_template(template, name):
    assert select_format(template).name == name


def test_an_override_names_the_format_and_an_unknown_one_is_refused():
    assert select_format(QWEN_TEMPLATE, "pythonic").name == "pythonic"
    with pytest.raises(ValueError, match="tool call parser"):
        select_format(QWEN_TEMPLATE, "llama4")


def _tool(name: str, **fn) -> dict:
    return {"type": "function", "function": {"name": name, **fn}}


@pytest.mark.parametrize("tools, field", [
    ([_tool("get weather")], "tools[0].function.name"),
    ([_tool("a" * 65)], "tools[0].function.name"),
    ([_tool("f"), _tool("f")], "tools[1].function.name"),
    ([_tool("f", parameters={"type": "array"})], "tools[0].function.parameters"),
    ([_tool("f", parameters=[])], "tools[0].function.parameters"),
])
def test_bad_tools_are_refused_naming_the_field(tools, field):
    with pytest.raises(InvalidRequestError) as err:
        parse_tools(tools)
    assert err.value.field == field


def test_tool_choice_becomes_a_tool_choice():
    tools = parse_tools([_tool("get-time_2", parameters={"type": "object"}), _tool("f", parameters={})])
    assert parse_tool_choice_spec(None, tools) == ToolChoice("auto")
    assert parse_tool_choice_spec(None, None) == ToolChoice("none")
    assert parse_tool_choice_spec("required", tools) == ToolChoice("required")
    named = {"type": "function", "function": {"name": "f"}}
    assert parse_tool_choice_spec(named, tools) == ToolChoice("function", "f")
    assert parse_tool_choice(named, tools) == named and parse_tool_choice("auto", tools) == "auto"


@pytest.mark.parametrize("choice, tools, field", [
    ({"type": "function", "function": {"name": "g"}}, [_tool("f")], "tool_choice"),
    ({"type": "function", "function": {"name": "f"}}, None, "tool_choice"),
    ({"type": "custom", "function": {"name": "f"}}, [_tool("f")], "tool_choice.type"),
    ("required", None, "tool_choice"),
    ("always", [_tool("f")], "tool_choice"),
])
def test_bad_tool_choice_is_refused_naming_it(choice, tools, field):
    with pytest.raises(InvalidRequestError) as err:
        parse_tool_choice_spec(choice, parse_tools(tools))
    assert err.value.field == field


def test_tool_choice_checks_its_own_shape():
    with pytest.raises(ValueError):
        ToolChoice("function")
    with pytest.raises(ValueError):
        ToolChoice("sometimes")


def test_the_tool_call_parser_flag_and_env_take_a_format_name_or_auto(tmp_path):
    from services.mesh.env_config import load_config
    from services.router.config import RouterConfig
    from weft.testing.tiny_model import make_tiny_checkpoint

    model_dir = str(make_tiny_checkpoint(tmp_path / "tiny"))

    def load(*argv: str, env: dict | None = None) -> RouterConfig:
        return load_config(RouterConfig, "router", "x", ["--model-dir", model_dir, *argv], env or {})

    assert load().tool_call_parser == "auto"
    assert load("--tool-call-parser", "mistral").tool_call_parser == "mistral"
    assert load(env={"WEFT_ROUTER_TOOL_CALL_PARSER": "pythonic"}).tool_call_parser == "pythonic"
    with pytest.raises(SystemExit):
        load("--tool-call-parser", "llama4")
