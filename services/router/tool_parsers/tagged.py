"""Formats whose calls sit between ``<tool_call>`` and ``</tool_call>``:

- ``hermes`` (Hermes, Qwen2.5): one JSON object per tag,
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
- ``smollm2`` (weft/models/chat_templates.py): a JSON array of calls in one tag,
  ``<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>``.

Both parse either body (an object, or an array whose every element is a call; ``[]`` is no
call) since models of one family write both. Plain text passes through as content, except
a tail that may be the start of ``<tool_call>`` (held until the next delta decides); a
block whose body is not a call comes back as content, tags included, so nothing the model
wrote is lost. A body is read as JSON, so a ``</tool_call>`` inside a string does not
close it; output cut short (max_tokens) inside a call keeps the complete calls before it
(docs/tools.md). They differ in what their grammar makes the model write.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.router.text_holdback import partial_marker_suffix
import services.router.tool_parsers.json_scan as js
import services.router.tool_parsers.structural as st
from services.router.tool_parsers.base import (
    StreamEvent, ToolCallFormat, ToolChoice, ToolStreamParser, call_from_json, calls_from_json_text,
)

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


class TaggedParser(ToolStreamParser):
    """Outside a block: content, holding back a tail that may start ``<tool_call>``. Inside:
    the body is read as JSON as it arrives, so a ``</tool_call>`` inside a string is text;
    the block closes at the first close tag after the complete value. A block's calls are
    sent when it closes (any element that is not a call keeps the whole block as content),
    or, for an array cut short by the end of the output, its complete calls at the end."""

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""  # outside: unsent text; inside: the block's body, from after the open tag
        self._inside = False

    def feed(self, text: str) -> list[StreamEvent]:
        self._buf += text
        return self._run(final=False)

    def flush(self) -> list[StreamEvent]:
        """An unterminated block still counts if its body is a complete call (or array);
        of an array cut short, the complete calls count and the incomplete tail is dropped."""
        events = self._run(final=True)
        self._content(self._buf, events)
        self._buf = ""
        return events

    def _run(self, final: bool) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        while self._body(events, final) if self._inside else self._text(events, final):
            pass
        return events

    def _text(self, events: list[StreamEvent], final: bool) -> bool:
        """Sends content up to an open tag; True when one was found."""
        start = self._buf.find(OPEN_TAG)
        if start < 0:
            cut = len(self._buf) - (0 if final else partial_marker_suffix(self._buf, (OPEN_TAG,)))
            self._content(self._buf[:cut], events)
            self._buf = self._buf[cut:]
            return False
        self._content(self._buf[:start], events)
        self._buf, self._inside = self._buf[start + len(OPEN_TAG):], True
        return True

    def _body(self, events: list[StreamEvent], final: bool) -> bool:
        """Reads the block's body; True when the block is over (``self._buf`` is then the text after it)."""
        body = self._buf
        pos = js.skip_space(body, 0)
        if pos < len(body) and body[pos] == "[":
            calls, end, state = js.complete_elements(body, pos, call_from_json)
            if state == "more" and not final:
                return False
            if state == "more" and (calls or self.num_tool_calls):
                return self._cut_short(calls, events)
            return self._close(body, end if state == "done" else None, events, final)
        end = js.value_end(body, pos) if pos < len(body) and body[pos] == "{" else None
        if end is None and (pos == len(body) or body[pos] == "{"):
            if not final:
                return False  # the value is still arriving
            if self.num_tool_calls:
                return self._cut_short([], events)
        return self._close(body, end, events, final)

    def _cut_short(self, calls: list, events: list[StreamEvent]) -> bool:
        """The output ended (max_tokens) inside a call after complete ones: those stand, the
        partial one is dropped (it is no text the model meant to show; the finish reason says
        the output was cut)."""
        self._buf, self._inside = "", False
        self._calls(calls, events)
        return True

    def _close(self, body: str, end: int | None, events: list[StreamEvent], final: bool) -> bool:
        """Ends the block at the close tag right after ``end`` (the complete value's end) or,
        failing that, at the first close tag; without one, waits for more text unless ``final``."""
        after = js.skip_space(body, end) if end is not None else 0
        if end is not None and CLOSE_TAG.startswith(body[after:]):
            if not final:
                return False  # the close tag may be arriving
            body = body[:after] + CLOSE_TAG  # the output ended inside the close tag (max_tokens)
        tag = after if body.startswith(CLOSE_TAG, after) else body.find(CLOSE_TAG, after)
        if tag < 0 and not final:
            return False
        closed = tag >= 0
        block = body[:tag] if closed else body
        self._buf, self._inside = (body[tag + len(CLOSE_TAG):] if closed else ""), False
        calls = calls_from_json_text(block[:end]) if end is not None and not block[end:].strip() else None
        if calls is None:
            self._content(OPEN_TAG + block + (CLOSE_TAG if closed else ""), events)
        else:
            self._calls(calls, events)
        return True


class HermesFormat(ToolCallFormat):
    name = "hermes"

    def stream_parser(self) -> ToolStreamParser:
        return TaggedParser()

    def grammar(self, tools: Sequence[dict[str, Any]], choice: ToolChoice, parallel: bool) -> str | None:
        if not tools:
            return None
        if choice.mode == "none":
            return st.structural_tag(st.any_text_except([OPEN_TAG]))
        call = st.tag(OPEN_TAG + "\n", st.call(st.chosen_tools(tools, choice)), "\n" + CLOSE_TAG)
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
        if not tools:
            return None
        if choice.mode == "none":
            return st.structural_tag(st.any_text_except([OPEN_TAG]))
        many = parallel and choice.mode != "function"
        block = st.tag(OPEN_TAG + "[", st.calls_array(st.chosen_tools(tools, choice), many), "]" + CLOSE_TAG)
        if choice.mode == "auto":
            return st.structural_tag(st.triggered(OPEN_TAG, [block], stop_after_first=True))
        return st.structural_tag(block)
