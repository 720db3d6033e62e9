"""Tool calls out of generated text, in the two tagged forms models are taught:

- ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``: one call per tag, the
  Hermes / Qwen2.5 convention their chat templates teach;
- ``<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>``: a JSON array of
  calls in one tag, SmolLM2's (weft/models/chat_templates.py); each element becomes one
  ``ToolCall``, and ``[]`` ("no call needed") becomes none.

``ToolCallParser`` works on a stream: plain text passes through as content, except a tail
that may be the start of ``<tool_call>`` (held until the next delta decides); a complete
tagged block becomes its ``ToolCall`` events. A block whose body is not one of the forms
above (every element a JSON object with a non-empty string ``name``) is returned as
content unchanged, so nothing the model wrote is lost.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from services.router.text_holdback import partial_marker_suffix

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it


@dataclass(frozen=True)
class ContentDelta:
    text: str


ParseEvent = ContentDelta | ToolCall


def parse_tool_call_body(body: str) -> list[ToolCall] | None:
    """The ToolCalls of one tag body (an object, or an array of objects), or None when
    it is not valid: all of an array's elements are calls, or the block is content."""
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, RecursionError):  # RecursionError: a body nested too deeply
        return None
    values = value if isinstance(value, list) else [value]
    calls = [_tool_call(v) for v in values]
    if any(c is None for c in calls):
        return None
    return calls


def _tool_call(value: object) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        arguments = args
    else:
        arguments = json.dumps(args, ensure_ascii=False)
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=value["name"], arguments=arguments)


class ToolCallParser:
    """Per-request streaming parser. Not thread-safe; one per stream.

    Once a tool call has been seen, whitespace-only content (the newlines between
    calls) is dropped, as OpenAI returns no content around tool calls.
    """

    def __init__(self) -> None:
        self._buf = ""
        self._inside = False
        self.num_tool_calls = 0

    def push(self, text: str) -> list[ParseEvent]:
        self._buf += text
        events: list[ParseEvent] = []
        while True:
            if self._inside:
                end = self._buf.find(CLOSE_TAG)
                if end < 0:
                    return events
                body, self._buf = self._buf[:end], self._buf[end + len(CLOSE_TAG) :]
                self._inside = False
                self._emit_call(body, events, closed=True)
            else:
                start = self._buf.find(OPEN_TAG)
                if start < 0:
                    keep = partial_marker_suffix(self._buf, (OPEN_TAG,))
                    cut = len(self._buf) - keep
                    self._emit_content(self._buf[:cut], events)
                    self._buf = self._buf[cut:]
                    return events
                self._emit_content(self._buf[:start], events)
                self._buf = self._buf[start + len(OPEN_TAG) :]
                self._inside = True

    def flush(self) -> list[ParseEvent]:
        """The stream ended: an unterminated call still counts if its body parses."""
        events: list[ParseEvent] = []
        if self._inside:
            self._emit_call(self._buf, events, closed=False)
        else:
            self._emit_content(self._buf, events)
        self._buf, self._inside = "", False
        return events

    def _emit_call(self, body: str, events: list[ParseEvent], closed: bool) -> None:
        calls = parse_tool_call_body(body.strip())
        if calls is None:
            raw = OPEN_TAG + body + (CLOSE_TAG if closed else "")
            events.append(ContentDelta(raw))
            return
        self.num_tool_calls += len(calls)
        events.extend(calls)

    def _emit_content(self, text: str, events: list[ParseEvent]) -> None:
        if not text or (self.num_tool_calls and not text.strip()):
            return
        events.append(ContentDelta(text))


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """Whole-text form: (content or None when empty beside calls, tool calls)."""
    parser = ToolCallParser()
    events = parser.push(text) + parser.flush()
    calls = [e for e in events if isinstance(e, ToolCall)]
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    if calls and not content.strip():
        return None, calls
    return content, calls
