"""Streaming text filters of the router: stop strings and tool-call parsing."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, strategies as st

from services.router.stop_strings import StopStringMatcher
from services.router.tool_calls import ContentDelta, ToolCall, ToolCallParser, parse_tool_calls


def _stream(matcher: StopStringMatcher, pieces: list[str]) -> str:
    out = "".join(matcher.push(p) for p in pieces)
    return out + matcher.flush()


def test_stop_string_split_across_deltas_is_matched_and_cut():
    m = StopStringMatcher(("###",))
    assert _stream(m, ["ab#", "#", "#cd"]) == "ab"
    assert m.stopped


def test_text_that_only_looks_like_a_stop_prefix_is_released_at_the_end():
    m = StopStringMatcher(("###",))
    assert m.push("ab##") == "ab"
    assert m.flush() == "##"
    assert not m.stopped


def test_earliest_of_several_stop_strings_wins():
    m = StopStringMatcher(("xyz", "b"))
    assert m.push("aaxyzb") == "aa"


@given(st.text(alphabet="ab#", max_size=30), st.lists(st.integers(1, 5), max_size=10))
def test_stop_matching_does_not_depend_on_how_text_is_split(text, cuts):
    pieces, rest = [], text
    for c in cuts:
        pieces.append(rest[:c])
        rest = rest[c:]
    pieces.append(rest)
    whole = text.split("##", 1)[0]
    assert _stream(StopStringMatcher(("##",)), pieces) == whole


def _events(pieces: list[str]):
    parser = ToolCallParser()
    events = [e for p in pieces for e in parser.push(p)] + parser.flush()
    return events


def test_tool_call_in_one_piece_becomes_a_call():
    content, calls = parse_tool_calls('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_tool_call_streamed_char_by_char_holds_back_the_tag():
    text = 'Sure. <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    events = _events(list(text))
    contents = "".join(e.text for e in events if isinstance(e, ContentDelta))
    assert contents == "Sure. "
    assert all("<" not in e.text for e in events if isinstance(e, ContentDelta))
    assert [e.name for e in events if isinstance(e, ToolCall)] == ["f"]


def test_two_calls_and_whitespace_between_them():
    text = '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n<tool_call>{"name": "b"}</tool_call>\n'
    content, calls = parse_tool_calls(text)
    assert content is None
    assert [c.name for c in calls] == ["a", "b"]
    assert calls[1].arguments == "{}"
    assert calls[0].id != calls[1].id


def test_invalid_tool_call_body_is_returned_as_text():
    text = "<tool_call>not json</tool_call>"
    content, calls = parse_tool_calls(text)
    assert calls == [] and content == text


def test_a_lone_less_than_sign_is_not_held_forever():
    assert parse_tool_calls("a < b")[0] == "a < b"
    events = _events(["a <", " b"])
    assert "".join(e.text for e in events) == "a < b"


def test_unterminated_but_complete_call_at_end_of_stream_counts():
    content, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"k": "v"}}')
    assert [c.name for c in calls] == ["f"] and content is None


# SmolLM2's form: a JSON array of calls inside one <tool_call> (weft/models/chat_templates.py).
SMOL_CALLS = ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
              '{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}]</tool_call>')


def test_a_json_array_in_one_tag_becomes_one_call_per_element():
    content, calls = parse_tool_calls(SMOL_CALLS)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("get_time", {"tz": "CET"})]
    assert calls[0].id != calls[1].id


def test_a_json_array_streamed_char_by_char_gives_the_same_calls():
    events = _events(list("Let me check.\n" + SMOL_CALLS))
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == "Let me check.\n"
    assert [e.name for e in events if isinstance(e, ToolCall)] == ["get_weather", "get_time"]


def test_an_empty_array_is_no_call_and_no_content():
    assert parse_tool_calls("<tool_call>[]</tool_call>") == ("", [])


@pytest.mark.parametrize("body", ['[{"name": "f"}, 3]', '[{"name": ""}]', '[{"arguments": {}}]', "[" * 100_000])
def test_an_array_with_any_invalid_element_stays_content(body):
    text = f"<tool_call>{body}</tool_call>"
    assert parse_tool_calls(text) == (text, [])
