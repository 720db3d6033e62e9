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
    the block closes at the first close tag after the complete value. An array's calls are
    sent one by one, each as soon as its element is complete."""

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""  # outside: unsent text; inside: the block's body, from after the open tag
        self._inside = False
        self._sent = 0  # inside an array: how many of its calls were sent

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
        self._buf, self._inside, self._sent = self._buf[start + len(OPEN_TAG):], True, 0
        return True

    def _body(self, events: list[StreamEvent], final: bool) -> bool:
        """Reads the block's body; True when the block is over (``self._buf`` is then the text after it)."""
        body = self._buf
        pos = js.skip_space(body, 0)
        if pos < len(body) and body[pos] == "[":
            return self._array(body, pos, events, final)
        end = js.value_end(body, pos) if pos < len(body) and body[pos] == "{" else None
        if end is None and not final and (pos == len(body) or body[pos] == "{"):
            return False  # the value is still arriving
        return self._close(body, end, events, final)

    def _array(self, body: str, pos: int, events: list[StreamEvent], final: bool) -> bool:
        calls, stop, state = js.complete_elements(body, pos, call_from_json)
        self._calls(calls[self._sent:], events)
        self._sent = len(calls)
        if state == "done":
            return self._close(body, stop, events, final)
        if state == "more" and not final:
            return False
        if not calls:  # not an array of calls after all: the block is content
            return self._close(body, None, events, final)
        if state == "more":  # cut short (max_tokens): the complete calls stand, the partial one is dropped
            self._buf, self._inside = "", False
            return True
        return self._close(body, None, events, final, rest_from=stop)

    def _close(self, body: str, end: int | None, events: list[StreamEvent], final: bool, rest_from: int = 0) -> bool:
        """Ends the block at the close tag right after ``end`` (the complete value's end) or,
        failing that, at the next close tag; without one, waits for more text unless ``final``."""
        after = js.skip_space(body, end) if end is not None else rest_from
        if end is not None and not final and CLOSE_TAG.startswith(body[after:]):
            return False  # the close tag may be arriving
        tag = after if body.startswith(CLOSE_TAG, after) else body.find(CLOSE_TAG, after)
        if tag < 0 and not final:
            return False
        closed = tag >= 0
        block = body[:tag] if closed else body
        self._buf, self._inside = (body[tag + len(CLOSE_TAG):] if closed else ""), False
        if self._sent:  # an array's calls were sent: what follows them in the block is content
            if not (closed and tag == after):  # a clean close leaves none
                self._content(block[after:] + (CLOSE_TAG if closed else ""), events)
            return True
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
