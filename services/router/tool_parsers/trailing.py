"""Formats whose calls run from a marker to the end of the output:

- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` after any text;
  call ids are 9 alphanumerics, which Mistral's templates insist on;
- ``llama3_json`` (Llama 3.1 / 3.2 JSON tool calling): the whole reply is
  ``{"name": ..., "parameters": {...}}``, possibly after ``<|python_tag|>``, several calls
  separated by ``;``.

``TrailingCallParser`` streams content until the marker (a tail that may be its start is
held back), then holds everything to the end: the calls are only certain once the output
is complete. What does not parse comes back as content, marker included.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from services.router.text_holdback import partial_marker_suffix
import services.router.tool_parsers.structural as st
from services.router.tool_parsers.base import (
    StreamEvent, ToolCall, ToolCallFormat, ToolChoice, ToolStreamParser, call_from_json, mistral_call_id,
    openai_call_id,
)

MISTRAL_MARKER = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"
LLAMA_TRIGGER = '{"name": '


class TrailingCallParser(ToolStreamParser):
    """``markers`` open the calls; with ``leading`` only at the start of the output (after
    whitespace), else anywhere. ``parse`` gets the text from the marker on."""

    def __init__(self, markers: tuple[str, ...], parse: Callable[[str], list[ToolCall] | None],
                 leading: bool) -> None:
        super().__init__()
        self._markers, self._parse, self._leading = markers, parse, leading
        self._buf = ""
        self._state = "scan"  # "scan" -> "calls" (held to the end) or, when leading, "text"

    def feed(self, text: str) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if self._state == "text":
            self._content(text, events)
            return events
        self._buf += text
        if self._state == "calls":
            return events
        if self._leading:
            self._scan_leading(events)
        else:
            self._scan_anywhere(events)
        return events

    def _scan_leading(self, events: list[StreamEvent]) -> None:
        head = self._buf.lstrip()
        if not head:
            return
        if any(head.startswith(m) for m in self._markers):
            self._state = "calls"
        elif not any(m.startswith(head) for m in self._markers):
            self._state = "text"
            self._content(self._buf, events)
            self._buf = ""

    def _scan_anywhere(self, events: list[StreamEvent]) -> None:
        found = [i for i in (self._buf.find(m) for m in self._markers) if i >= 0]
        if found:
            self._content(self._buf[:min(found)], events)
            self._buf = self._buf[min(found):]
            self._state = "calls"
            return
        cut = len(self._buf) - partial_marker_suffix(self._buf, self._markers)
        self._content(self._buf[:cut], events)
        self._buf = self._buf[cut:]

    def flush(self) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        calls = self._parse(self._buf.strip()) if self._state == "calls" else None
        if calls is None:
            self._content(self._buf, events)
        else:
            self._calls(calls, events)
        self._buf, self._state = "", "scan"
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


def _parse_mistral(text: str) -> list[ToolCall] | None:
    values = json_values(text[len(MISTRAL_MARKER):])
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
        return TrailingCallParser((MISTRAL_MARKER,), _parse_mistral, leading=False)

    def grammar(self, tools: Sequence[dict[str, Any]], choice: ToolChoice, parallel: bool) -> str | None:
        if choice.mode == "none" or not tools:
            return None
        many = parallel and choice.mode != "function"
        block = st.tag(MISTRAL_MARKER, st.json_format(st.calls_array_schema(st.chosen_tools(tools, choice), many)), "")
        if choice.mode == "auto":
            return st.structural_tag(st.triggered(MISTRAL_MARKER, [block], stop_after_first=True))
        return st.structural_tag(block)


class Llama3JsonFormat(ToolCallFormat):
    name = "llama3_json"

    def stream_parser(self) -> ToolStreamParser:
        return TrailingCallParser((PYTHON_TAG, "{"), _parse_llama, leading=True)

    def grammar(self, tools: Sequence[dict[str, Any]], choice: ToolChoice, parallel: bool) -> str | None:
        if choice.mode == "none" or not tools:
            return None
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
