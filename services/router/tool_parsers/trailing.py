"""Formats whose calls run from a marker to the end of the output:

- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` after any text
  (or the bare array at the start of the output, for text decoded without the marker's
  control token); call ids are 9 alphanumerics, which Mistral's templates insist on;
- ``llama3_json`` (Llama 3.1 / 3.2 JSON tool calling): the whole reply is
  ``{"name": ..., "parameters": {...}}``, possibly after ``<|python_tag|>``, several calls
  separated by ``;``.

``TrailingCallParser`` streams content until a marker (a tail that may be one's start is
held back), then holds everything to the end: the calls are only certain once the output
is complete. What does not parse comes back as content, marker included, unless it was
cut short after complete calls (max_tokens): those stand, the partial one is dropped.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from services.router.text_holdback import partial_marker_suffix
import services.router.tool_parsers.json_scan as js
import services.router.tool_parsers.structural as st
from services.router.tool_parsers.base import (
    StreamEvent, ToolCall, ToolCallFormat, ToolChoice, ToolStreamParser, call_from_json, mistral_call_id,
    openai_call_id,
)

MISTRAL_MARKER = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"
LLAMA_TRIGGER = '{"name": '


class TrailingCallParser(ToolStreamParser):
    """Calls open with one of ``leading`` at the start of the output (after whitespace) or
    one of ``anywhere`` at any point, and run to the end. ``parse`` gets the text from the
    marker on."""

    def __init__(self, parse: Callable[[str], list[ToolCall] | None], leading: tuple[str, ...] = (),
                 anywhere: tuple[str, ...] = (), salvage: Callable[[str], list[ToolCall] | None] | None = None) -> None:
        super().__init__()
        self._parse, self._leading, self._anywhere = parse, leading, anywhere
        self._salvage = salvage  # the complete calls of a text cut short (max_tokens), or None
        self._buf = ""
        self._state = "start"  # -> "calls" (held to the end), "scan" (for an anywhere marker) or "text"

    def feed(self, text: str) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if self._state == "text":
            self._content(text, events)
            return events
        self._buf += text
        if self._state == "start":
            self._start(events)
        if self._state == "scan":
            self._scan(events)
        return events

    def _start(self, events: list[StreamEvent]) -> None:
        head, markers = self._buf.lstrip(), self._leading + self._anywhere
        if not head:
            return
        if any(head.startswith(m) for m in markers):
            self._state = "calls"
        elif not any(m.startswith(head) for m in markers):  # not a marker, nor the start of one
            self._state = "scan" if self._anywhere else "text"
            if self._state == "text":
                self._content(self._buf, events)
                self._buf = ""

    def _scan(self, events: list[StreamEvent]) -> None:
        found = [i for i in (self._buf.find(m) for m in self._anywhere) if i >= 0]
        if found:
            self._content(self._buf[:min(found)], events)
            self._buf = self._buf[min(found):]
            self._state = "calls"
            return
        cut = len(self._buf) - partial_marker_suffix(self._buf, self._anywhere)
        self._content(self._buf[:cut], events)
        self._buf = self._buf[cut:]

    def flush(self) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        calls = self._parse(self._buf.strip()) if self._state == "calls" else None
        cut = 0
        if calls is None and self._state == "calls":  # a leading "[" that was text: a marker later?
            for cut in (i for i in (self._buf.find(m, 1) for m in self._anywhere) if i > 0):
                calls = self._parse(self._buf[cut:].strip())
                if calls is not None:
                    break
        if calls is None and self._state == "calls" and self._salvage is not None:
            cut, calls = 0, self._salvage(self._buf.strip())  # its incomplete last call is dropped
        if calls is None:
            self._content(self._buf, events)
        else:
            self._content(self._buf[:cut], events)
            self._calls(calls, events)
        self._buf, self._state = "", "start"
        return events


def json_values(text: str) -> list[Any] | None:
    """The JSON values of ``text`` written one after another, separated by whitespace or
    ``;``; None when anything else is there."""
    decoder, values, pos = json.JSONDecoder(), [], 0
    try:
        while True:
            while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
                pos += 1
            if pos == len(text):
                return values
            value, pos = decoder.raw_decode(text, pos)
            values.append(value)
    except (json.JSONDecodeError, RecursionError):
        return None


def _salvage_mistral(text: str) -> list[ToolCall] | None:
    """The complete calls of an array cut short; None when there are none."""
    text = text.removeprefix(MISTRAL_MARKER).lstrip()
    if not text.startswith("["):
        return None
    calls, _, state = js.complete_elements(text, 0, lambda v: call_from_json(v, mistral_call_id))
    return calls if calls and state == "more" else None


def _salvage_llama(text: str) -> list[ToolCall] | None:
    """The complete calls before one cut short; None when there are none."""
    text = text.removeprefix(PYTHON_TAG)
    cut = text.rfind(";")
    tail = js.skip_space(text, cut + 1)
    if cut < 0 or not text.startswith("{", tail) or js.value_end(text, tail) is not None:
        return None  # no complete call before it, or the last one is not cut short
    values = json_values(text[:cut])
    calls = [call_from_json(v, openai_call_id, args_keys=("parameters", "arguments")) for v in values or ()]
    return calls if calls and None not in calls else None  # type: ignore[return-value]


def _parse_mistral(text: str) -> list[ToolCall] | None:
    values = json_values(text.removeprefix(MISTRAL_MARKER))
    if not values or len(values) != 1 or not isinstance(values[0], list):
        return None
    calls = [call_from_json(v, mistral_call_id) for v in values[0]]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


def _parse_llama(text: str) -> list[ToolCall] | None:
    values = json_values(text.removeprefix(PYTHON_TAG))
    if not values:
        return None
    calls = [call_from_json(v, openai_call_id, args_keys=("parameters", "arguments")) for v in values]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


class MistralFormat(ToolCallFormat):
    name = "mistral"

    def stream_parser(self) -> ToolStreamParser:
        # "[" at the start too: the marker is a control token, which text decoded without
        # special tokens loses; the array of calls that follows it is still recognised.
        return TrailingCallParser(_parse_mistral, leading=("[",), anywhere=(MISTRAL_MARKER,), salvage=_salvage_mistral)

    def grammar(self, tools: Sequence[dict[str, Any]], choice: ToolChoice, parallel: bool) -> str | None:
        if not tools:
            return None
        if choice.mode == "none":
            return st.structural_tag(st.any_text_except([MISTRAL_MARKER]))
        many = parallel and choice.mode != "function"
        block = st.tag(MISTRAL_MARKER + "[", st.calls_array(st.chosen_tools(tools, choice), many), "]")
        if choice.mode == "auto":
            return st.structural_tag(st.triggered(MISTRAL_MARKER, [block], stop_after_first=True))
        return st.structural_tag(block)


class Llama3JsonFormat(ToolCallFormat):
    name = "llama3_json"

    def stream_parser(self) -> ToolStreamParser:
        return TrailingCallParser(_parse_llama, leading=(PYTHON_TAG, "{"), salvage=_salvage_llama)

    def grammar(self, tools: Sequence[dict[str, Any]], choice: ToolChoice, parallel: bool) -> str | None:
        if not tools:
            return None
        if choice.mode == "none":
            return st.structural_tag(st.any_text_except([PYTHON_TAG, LLAMA_TRIGGER]))
        # One tag per tool, its name spelled in the begin string, as Llama writes
        # ``{"name": "f", "parameters": {...}}``: the trigger is the common prefix.
        calls = [st.tag(f'{LLAMA_TRIGGER}{json.dumps(t["function"]["name"])}, "parameters": ',
                        st.json_format(st.parameters_schema(t)), "}")
                 for t in st.chosen_tools(tools, choice)]
        if choice.mode == "auto":
            return st.structural_tag(st.triggered(LLAMA_TRIGGER, calls, stop_after_first=not parallel))
        if choice.mode == "function":
            return st.structural_tag(calls[0])
        return st.structural_tag(st.repeated(calls, "; ", parallel))
