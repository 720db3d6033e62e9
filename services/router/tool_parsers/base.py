"""The vocabulary every tool-call format shares: the request's ``ToolChoice``, a parsed
``ToolCall``, the stream events a door turns into OpenAI deltas, and the two interfaces a
format implements (``ToolCallFormat``, and the ``ToolStreamParser`` it hands out per stream).

A stream's events map 1:1 onto OpenAI's chunks: ``ToolCallStart`` is the first delta of a
call (``{index, id, type, function: {name, arguments: ""}}``), each ``ToolCallArgsDelta`` an
``arguments`` fragment of the call with that index, ``ContentDelta`` ordinary content.
"""
from __future__ import annotations

import json
import secrets
import string
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

TOOL_CHOICE_MODES = ("auto", "none", "required", "function")


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "auto" | "none" | "required" | "function"
    name: str = ""  # the function's name, with mode "function"

    def __post_init__(self) -> None:
        if self.mode not in TOOL_CHOICE_MODES:
            raise ValueError(f"tool choice mode must be one of {TOOL_CHOICE_MODES}, got {self.mode!r}")
        if (self.mode == "function") != bool(self.name):
            raise ValueError("a tool choice names a function exactly when its mode is 'function'")


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgsDelta:
    index: int
    text: str


StreamEvent = ContentDelta | ToolCallStart | ToolCallArgsDelta


def openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


_ALNUM = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """Mistral's templates require exactly 9 alphanumerics."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


def call_from_json(value: object, new_id: Callable[[], str] = openai_call_id,
                   args_keys: Sequence[str] = ("arguments", "parameters")) -> ToolCall | None:
    """A ``{"name": ..., "arguments": {...}}`` object as a ToolCall; None when it is not one
    (not an object, no non-empty string name, arguments neither an object nor a string)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    args: Any = next((value[k] for k in args_keys if k in value), {})
    if isinstance(args, str):
        arguments = args
    elif isinstance(args, dict):
        arguments = json.dumps(args, ensure_ascii=False)
    else:
        return None
    return ToolCall(id=new_id(), name=value["name"], arguments=arguments)


def calls_from_json_text(text: str, new_id: Callable[[], str] = openai_call_id) -> list[ToolCall] | None:
    """The calls of a JSON object or array of objects; None unless every element is a call."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):  # RecursionError: nested too deeply
        return None
    values = value if isinstance(value, list) else [value]
    calls = [call_from_json(v, new_id) for v in values]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


class ToolStreamParser(ABC):
    """Per-stream parser: text deltas in, events out. Not thread-safe; one per stream.

    Subclasses call ``_calls`` and ``_content``; once a call was seen, whitespace-only
    content (the newlines between calls) is dropped, as OpenAI returns none around calls."""

    def __init__(self) -> None:
        self.num_tool_calls = 0

    @abstractmethod
    def feed(self, text: str) -> list[StreamEvent]: ...

    @abstractmethod
    def flush(self) -> list[StreamEvent]:
        """The stream ended: what was held back, as content or calls."""

    def _calls(self, calls: Sequence[ToolCall], events: list[StreamEvent]) -> None:
        for call in calls:
            events.append(ToolCallStart(self.num_tool_calls, call.id, call.name))
            events.append(ToolCallArgsDelta(self.num_tool_calls, call.arguments))
            self.num_tool_calls += 1

    def _content(self, text: str, events: list[StreamEvent]) -> None:
        if not text or (self.num_tool_calls and not text.strip()):
            return
        events.append(ContentDelta(text))


def collect(events: Sequence[StreamEvent]) -> tuple[str | None, list[ToolCall]]:
    """Whole-text form of a stream's events: (content, or None when empty beside calls; calls)."""
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    args = {s.index: "" for s in starts}
    for e in events:
        if isinstance(e, ToolCallArgsDelta):
            args[e.index] += e.text
    calls = [ToolCall(s.id, s.name, args[s.index]) for s in starts]
    if calls and not content.strip():
        return None, calls
    return content, calls


class ToolCallFormat(ABC):
    """One model family's convention for writing tool calls: how to parse them out of the
    generated text, and the structural tag that makes the engine write them correctly."""

    name: str

    @abstractmethod
    def stream_parser(self) -> ToolStreamParser: ...

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, or None when empty beside calls; calls) of a whole generated text."""
        parser = self.stream_parser()
        return collect(parser.feed(text) + parser.flush())

    @abstractmethod
    def grammar(self, tools: Sequence[dict[str, Any]], choice: ToolChoice, parallel: bool) -> str | None:
        """Structural tag JSON text (xgrammar's format) enforcing ``choice`` over ``tools``
        (OpenAI tool dicts), for ``SamplingParams.grammar.structural_tag``; None: no constraint."""
