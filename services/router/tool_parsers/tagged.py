"""Formats whose calls sit between ``<tool_call>`` and ``</tool_call>``:

- ``hermes`` (Hermes, Qwen2.5): one JSON object per tag,
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
- ``smollm2`` (weft/models/chat_templates.py): a JSON array of calls in one tag,
  ``<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>``.

Both parse either body (an object, or an array whose every element is a call; ``[]`` is no
call) since models of one family write both. Plain text passes through as content, except
a tail that may be the start of ``<tool_call>`` (held until the next delta decides); a
block whose body is not a call comes back as content, tags included, so nothing the model
wrote is lost. They differ in what their grammar makes the model write.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.router.text_holdback import partial_marker_suffix
import services.router.tool_parsers.structural as st
from services.router.tool_parsers.base import (
    StreamEvent, ToolCallFormat, ToolChoice, ToolStreamParser, calls_from_json_text,
)

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


class TaggedParser(ToolStreamParser):
    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._inside = False

    def feed(self, text: str) -> list[StreamEvent]:
        self._buf += text
        events: list[StreamEvent] = []
        while True:
            if self._inside:
                end = self._buf.find(CLOSE_TAG)
                if end < 0:
                    return events
                body, self._buf = self._buf[:end], self._buf[end + len(CLOSE_TAG):]
                self._inside = False
                self._block(body, events, closed=True)
            else:
                start = self._buf.find(OPEN_TAG)
                if start < 0:
                    cut = len(self._buf) - partial_marker_suffix(self._buf, (OPEN_TAG,))
                    self._content(self._buf[:cut], events)
                    self._buf = self._buf[cut:]
                    return events
                self._content(self._buf[:start], events)
                self._buf = self._buf[start + len(OPEN_TAG):]
                self._inside = True

    def flush(self) -> list[StreamEvent]:
        """An unterminated call still counts if its body parses."""
        events: list[StreamEvent] = []
        if self._inside:
            self._block(self._buf, events, closed=False)
        else:
            self._content(self._buf, events)
        self._buf, self._inside = "", False
        return events

    def _block(self, body: str, events: list[StreamEvent], closed: bool) -> None:
        calls = calls_from_json_text(body.strip())
        if calls is None:
            self._content(OPEN_TAG + body + (CLOSE_TAG if closed else ""), events)
        else:
            self._calls(calls, events)


class HermesFormat(ToolCallFormat):
    name = "hermes"

    def stream_parser(self) -> ToolStreamParser:
        return TaggedParser()

    def grammar(self, tools: Sequence[dict[str, Any]], choice: ToolChoice, parallel: bool) -> str | None:
        if choice.mode == "none" or not tools:
            return None
        call = st.tag(OPEN_TAG + "\n", st.json_format(st.call_schema(st.chosen_tools(tools, choice))),
                      "\n" + CLOSE_TAG)
        if choice.mode == "auto":
            return st.structural_tag(st.triggered(OPEN_TAG, [call], stop_after_first=not parallel))
        if choice.mode == "function":
            return st.structural_tag(call)
        return st.structural_tag(st.repeated([call], "\n", parallel))


class SmolLM2Format(ToolCallFormat):
    name = "smollm2"

    def stream_parser(self) -> ToolStreamParser:
        return TaggedParser()

    def grammar(self, tools: Sequence[dict[str, Any]], choice: ToolChoice, parallel: bool) -> str | None:
        if choice.mode == "none" or not tools:
            return None
        many = parallel and choice.mode != "function"
        block = st.tag(OPEN_TAG, st.json_format(st.calls_array_schema(st.chosen_tools(tools, choice), many)),
                       CLOSE_TAG)
        if choice.mode == "auto":
            return st.structural_tag(st.triggered(OPEN_TAG, [block], stop_after_first=True))
        return st.structural_tag(block)
