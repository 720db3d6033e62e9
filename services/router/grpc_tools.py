"""Tools on the public gRPC door (``weft.v1.Router.Generate``): ``tools``, ``tool_choice``,
``parallel_tool_calls`` and assistant messages' ``tool_calls`` in, ``GenerateResponse.tool_calls``
out. Conversion only: validation is HTTP's (``chat_messages.parse_tools`` /
``parse_tool_choice_spec`` / ``parse_message``) over the JSON a proto field would be, so both
doors refuse the same input; the parsing and the grammar are the served model's
``tool_parsers.ToolCallFormat``.

A stream's calls leave whole: ``ToolCallRelay`` turns the format's stream events into text
(markup removed) and complete calls, each sent once. A call is complete once its arguments
parse as a JSON object (no proper prefix of an object is one), or when anything follows it.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from services.router.chat_messages import parse_tools, parse_tool_choice_spec
from services.router.errors import InvalidRequestError
from services.router.schema import Sampling
from services.router.tool_grammar import tool_grammar
from services.router.tool_parsers import (ContentDelta, StreamEvent, ToolCall, ToolCallArgsDelta, ToolCallFormat,
                                          ToolCallStart, ToolChoice)
from weft.v1 import router_pb2

_MODES = {router_pb2.ToolChoice.MODE_AUTO: "auto", router_pb2.ToolChoice.MODE_NONE: "none",
          router_pb2.ToolChoice.MODE_REQUIRED: "required", router_pb2.ToolChoice.MODE_FUNCTION: "function"}


def tools_from_proto(request: router_pb2.GenerateRequest) -> tuple[dict[str, Any], ...] | None:
    """``request.tools`` as OpenAI tool dicts (what the chat template and the formats read)."""
    if not request.tools:
        return None
    if request.WhichOneof("prompt") != "chat":
        raise InvalidRequestError("tools", "tools need a chat prompt")
    return parse_tools([_tool(t, i) for i, t in enumerate(request.tools)])


def _tool(tool: router_pb2.ToolDefinition, i: int) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": tool.name}
    if tool.description:
        fn["description"] = tool.description
    if tool.parameters_json:
        fn["parameters"] = _json_text(tool.parameters_json, f"tools[{i}].parameters_json")
    return {"type": "function", "function": fn}


def _json_text(text: str, field: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise InvalidRequestError(field, f"must be JSON text: {exc}") from None


def tool_choice_from_proto(request: router_pb2.GenerateRequest, tools: tuple[dict[str, Any], ...] | None) -> ToolChoice:
    """``request.tool_choice``; unset (or MODE_UNSPECIFIED) is auto with tools, none without."""
    c = request.tool_choice
    if c.mode not in _MODES and c.mode != router_pb2.ToolChoice.MODE_UNSPECIFIED:
        raise InvalidRequestError("tool_choice.mode", f"undefined mode {c.mode}")
    mode = _MODES.get(c.mode)
    if c.function_name and mode != "function":
        raise InvalidRequestError("tool_choice.function_name", "is only read with MODE_FUNCTION")
    if mode == "function":
        if not c.function_name:
            raise InvalidRequestError("tool_choice.function_name", "is required with MODE_FUNCTION")
        value: Any = {"type": "function", "function": {"name": c.function_name}}
    else:
        value = mode
    return parse_tool_choice_spec(value, tools)


def with_tool_grammar(sampling: Sampling, fmt: ToolCallFormat, tools: tuple[dict[str, Any], ...] | None,
                      choice: ToolChoice, parallel: bool) -> tuple[Sampling, str]:
    """``sampling`` with the structural tag that makes the engine write the chosen calls in
    ``fmt``'s form, and the request field a refusal of the grammar names; HTTP's rules
    (``tool_grammar.tool_grammar``)."""
    own = f"sampling.grammar.{sampling.grammar[0]}" if sampling.grammar else "sampling.grammar"
    grammar = tool_grammar(fmt, tools, choice, parallel, sampling.grammar is not None, "sampling.grammar",
                           "tools[{}].parameters_json")
    if grammar is None:
        return sampling, own
    return replace(sampling, grammar=("structural_tag", grammar)), "tool_choice"


def assistant_tool_calls(msg: router_pb2.ChatMessage) -> list[dict[str, Any]]:
    """An assistant message's calls as the JSON HTTP carries (``parse_message`` validates)."""
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json or "{}"}}
            for c in msg.tool_calls]


def to_proto(calls: Sequence[ToolCall]) -> list[router_pb2.ToolCall]:
    return [router_pb2.ToolCall(id=c.id, name=c.name, arguments_json=c.arguments) for c in calls]


class ToolCallRelay:
    """One stream's text in, (text without call markup, complete calls) out."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self._parser = fmt.stream_parser()
        self._pending: ToolCall | None = None  # started, arguments maybe incomplete
        self.num_calls = 0  # calls released so far

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        return self._relay(self._parser.feed(text), final=False)

    def flush(self) -> tuple[str, list[ToolCall]]:
        return self._relay(self._parser.flush(), final=True)

    def _relay(self, events: list[StreamEvent], final: bool) -> tuple[str, list[ToolCall]]:
        text, calls = [], []
        for e in events:
            if isinstance(e, ToolCallArgsDelta) and self._pending is not None:
                p = self._pending
                self._pending = ToolCall(p.id, p.name, p.arguments + e.text)
                continue
            self._release(calls)  # anything after a call ends it
            if isinstance(e, ToolCallStart):
                self._pending = ToolCall(e.id, e.name, "")
            elif isinstance(e, ContentDelta):
                text.append(e.text)
        if self._pending is not None and (final or _is_object(self._pending.arguments)):
            self._release(calls)
        return "".join(text), calls

    def _release(self, calls: list[ToolCall]) -> None:
        if self._pending is not None:
            calls.append(self._pending)
            self._pending = None
            self.num_calls += 1


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (json.JSONDecodeError, RecursionError):
        return False
