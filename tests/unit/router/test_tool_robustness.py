"""Tool-call parsing where the old parsers lost calls (issue 15's SmolLM2 runs): a close
tag inside an argument string, and a call array cut short by ``max_tokens``."""
from __future__ import annotations

import json

import pytest

from services.router.tool_parsers import FORMATS, ToolCallStart, collect


def _stream(fmt: str, pieces: list[str]):
    parser = FORMATS[fmt].stream_parser()
    events = [e for piece in pieces for e in parser.feed(piece)]
    return events + parser.flush()


def _both(fmt: str, text: str):
    """(whole-text result, char-by-char streamed result) as (content, [(name, args)])."""
    def calls(result):
        content, found = result
        return content, [(c.name, json.loads(c.arguments)) for c in found]
    return calls(FORMATS[fmt].parse(text)), calls(collect(_stream(fmt, list(text))))


@pytest.mark.parametrize("fmt, text", [
    ("hermes", '<tool_call>\n{"name": "note", "arguments": {"text": "see </tool_call> here"}}\n</tool_call>'),
    ("smollm2", '<tool_call>[{"name": "note", "arguments": {"text": "see </tool_call> here"}}]</tool_call>'),
    ("smollm2", '<tool_call>[{"name": "note", "arguments": {"text": "a \\"</tool_call>\\" b"}}]</tool_call>'),
])
def test_a_close_tag_inside_an_argument_string_does_not_end_the_call(fmt, text):
    args = json.loads(text[text.index("{"):text.rindex("}") + 1])["arguments"]
    whole, streamed = _both(fmt, text)
    assert whole == streamed == (None, [("note", args)])


def test_text_after_a_block_whose_argument_holds_the_close_tag_is_content():
    text = '<tool_call>[{"name": "n", "arguments": {"t": "</tool_call>"}}]</tool_call> done'
    for content, calls in _both("smollm2", text):  # (a streamed lone " " after a call is dropped)
        assert (content.strip(), calls) == ("done", [("n", {"t": "</tool_call>"})])


CUT = '<tool_call>[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {"b": 2}}, {"name": "f", "argu'


@pytest.mark.parametrize("fmt", ["smollm2", "hermes"])
def test_an_array_cut_short_keeps_its_complete_calls_and_drops_the_partial_one(fmt):
    whole, streamed = _both(fmt, CUT)
    assert whole == streamed == (None, [("f", {"a": 1}), ("g", {"b": 2})])


def test_an_array_cut_short_sends_its_complete_calls_when_the_stream_ends():
    parser = FORMATS["smollm2"].stream_parser()
    assert parser.feed(CUT) == []  # held: a later element that is not a call would make it content
    assert [(e.index, e.name) for e in parser.flush() if isinstance(e, ToolCallStart)] == [(0, "f"), (1, "g")]


def test_an_element_that_is_not_a_call_keeps_the_whole_block_as_content():
    text = '<tool_call>[{"name": "f", "arguments": {}}, "oops"]</tool_call> after'
    assert _both("smollm2", text) == ((text, []), (text, []))


@pytest.mark.parametrize("fmt, text, calls", [
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "argum', [("f", {"a": 1})]),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "param', [("f", {"a": 1})]),
])
def test_trailing_formats_cut_short_keep_their_complete_calls(fmt, text, calls):
    whole, streamed = _both(fmt, text)
    assert whole == streamed == (None, calls)


@pytest.mark.parametrize("cut", ["</tool_call", "</", "\n"])
def test_an_array_cut_inside_its_close_tag_is_still_its_calls(cut):
    text = '<tool_call>[{"name": "f", "arguments": {"a": 1}}]' + cut
    assert _both("smollm2", text) == ((None, [("f", {"a": 1})]),) * 2


@pytest.mark.parametrize("tail", ['<tool_call>\n{"name": "g", "argu', '<tool_call>[{"name": "g"', "<tool_call>"])
def test_a_hermes_block_cut_short_after_complete_calls_is_dropped(tail):
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n' + tail
    assert _both("hermes", text) == ((None, [("f", {"a": 1})]),) * 2


def test_a_cut_with_no_complete_call_stays_content():
    for fmt, text in (("smollm2", '<tool_call>[{"name": "f", "argu'), ("mistral", '[TOOL_CALLS][{"name": "f"')):
        assert _both(fmt, text) == ((text, []), (text, []))
    assert FORMATS["smollm2"].parse("a <tool_call>[{") == ("a <tool_call>[{", [])


def test_unbalanced_json_in_a_block_loses_no_text():
    text = '<tool_call>{"name": "f"</tool_call> then <tool_call>[{"name": "g", "arguments": {}}]</tool_call>'
    whole, streamed = _both("smollm2", text)
    assert whole == streamed
    content, calls = whole
    assert content is not None and content.startswith('<tool_call>{"name": "f"')
    assert calls in ([], [("g", {})])
