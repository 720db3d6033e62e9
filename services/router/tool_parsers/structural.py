"""Building blocks of the structural tags the formats hand the engine (xgrammar 0.2.9's
``{"type": "structural_tag", "format": {...}}``), as plain dicts.

A call is constrained as one JSON object, ``{"name": <one of the tools>, "arguments":
<that tool's parameters schema>}``, in the order the formats write them; a tool without
``parameters`` takes any object. The engine compiles the text; nothing here imports
xgrammar, so the router stays light.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from services.router.errors import InvalidRequestError
from services.router.tool_parsers.base import ToolChoice

ANY_OBJECT: dict[str, Any] = {"type": "object"}
MAX_JSON_WHITESPACE = 32  # consecutive whitespace characters between a call's JSON tokens


def chosen_tools(tools: Sequence[dict[str, Any]], choice: ToolChoice) -> list[dict[str, Any]]:
    """The tools a call may name: all of them, or the one ``tool_choice`` names."""
    if choice.mode != "function":
        return list(tools)
    chosen = [t for t in tools if t["function"]["name"] == choice.name]
    if not chosen:  # parse_tool_choice_spec refuses this first; a grammar of no call is no answer
        raise InvalidRequestError("tool_choice", f"names function {choice.name!r}, which is not in tools")
    return chosen


def parameters_schema(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or ANY_OBJECT


def call_schema(tools: Sequence[dict[str, Any]], args_key: str = "arguments") -> dict[str, Any]:
    """JSON Schema of one call object naming one of ``tools``."""
    options = [{"type": "object",
                "properties": {"name": {"const": t["function"]["name"]}, args_key: parameters_schema(t)},
                "required": ["name", args_key], "additionalProperties": False} for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def calls_array_schema(tools: Sequence[dict[str, Any]], parallel: bool, args_key: str = "arguments") -> dict[str, Any]:
    """JSON Schema of a non-empty array of calls (exactly one without ``parallel``)."""
    schema: dict[str, Any] = {"type": "array", "items": call_schema(tools, args_key), "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def json_format(schema: dict[str, Any]) -> dict[str, Any]:
    # Bounded whitespace: pretty-printing still fits, but a small model cannot spend its
    # whole budget on newlines inside a call (a known failure of unbounded JSON grammars).
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_JSON_WHITESPACE}


def tag(begin: str, content: dict[str, Any], end: str) -> dict[str, Any]:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def triggered(trigger: str, tags: list[dict[str, Any]], stop_after_first: bool) -> dict[str, Any]:
    """Free text until ``trigger``; from there one of ``tags``, then free text again."""
    return {"type": "triggered_tags", "triggers": [trigger], "tags": tags,
            "stop_after_first": stop_after_first}


def repeated(tags: list[dict[str, Any]], separator: str, parallel: bool) -> dict[str, Any]:
    """One or more of ``tags`` (exactly one without ``parallel``) and nothing else."""
    return {"type": "tags_with_separator", "tags": tags, "separator": separator,
            "at_least_one": True, "stop_after_first": not parallel}


def structural_tag(fmt: dict[str, Any]) -> str:
    return json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)
