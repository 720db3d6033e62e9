"""Compatibility shim: the tool-call parsers moved to ``services.router.tool_parsers``
(one plug-in per model family's format). These names keep the doors that still import
them working, with the Hermes / SmolLM2 ``<tool_call>`` forms and whole-call events;
new code uses ``tool_parsers.select_format(...).stream_parser()`` and its streamed
``ToolCallStart`` / ``ToolCallArgsDelta`` events.
"""
from __future__ import annotations

from services.router.tool_parsers import FORMATS, ContentDelta, ToolCall, ToolCallArgsDelta, ToolCallStart
from services.router.tool_parsers.tagged import CLOSE_TAG, OPEN_TAG

__all__ = ["CLOSE_TAG", "OPEN_TAG", "ContentDelta", "ParseEvent", "ToolCall", "ToolCallParser", "parse_tool_calls"]

ParseEvent = ContentDelta | ToolCall


class ToolCallParser:
    """The ``<tool_call>`` stream parser with each call as one ``ToolCall`` event."""

    def __init__(self) -> None:
        self._parser = FORMATS["hermes"].stream_parser()
        self._calls: dict[int, ToolCall] = {}

    @property
    def num_tool_calls(self) -> int:
        return self._parser.num_tool_calls

    def push(self, text: str) -> list[ParseEvent]:
        return self._whole_calls(self._parser.feed(text))

    def flush(self) -> list[ParseEvent]:
        return self._whole_calls(self._parser.flush())

    def _whole_calls(self, events) -> list[ParseEvent]:
        out: list[ParseEvent] = []
        for e in events:
            if isinstance(e, ToolCallStart):
                self._calls[e.index] = ToolCall(e.id, e.name, "")
            elif isinstance(e, ToolCallArgsDelta):  # the tagged parser sends a call's arguments whole
                call = self._calls.pop(e.index)
                out.append(ToolCall(call.id, call.name, call.arguments + e.text))
            else:
                out.append(e)
        return out


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """Whole-text form: (content or None when empty beside calls, tool calls)."""
    return FORMATS["hermes"].parse(text)
