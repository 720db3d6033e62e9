"""Building blocks of the structural tags the formats hand the engine (xgrammar 0.2.9's
``{"type": "structural_tag", "format": {...}}``), as plain dicts.

A call is constrained as one compact JSON object, ``{"name": <one of the tools>,
"arguments": <that tool's parameters schema>}``, in the order the formats write them; a
tool without ``parameters`` takes any object. ``any_text_except`` is the grammar of
``tool_choice: "none"``: free text in which the format's call marker cannot appear. The engine compiles the text; nothing here imports
xgrammar, so the router stays light.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from services.router.errors import InvalidRequestError
from services.router.tool_parsers.base import ToolChoice

ANY_OBJECT: dict[str, Any] = {"type": "object"}
MAX_JSON_WHITESPACE = 1  # consecutive whitespace characters between an arguments object's JSON tokens


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


def call(tools: Sequence[dict[str, Any]], args_key: str = "arguments") -> dict[str, Any]:
    """One call of one of ``tools``, in compact form: ``{"name": "f", "arguments": `` is
    fixed text (the spacing the templates show), only the arguments object is JSON Schema
    (with at most one whitespace character in a row). A call then has no newlines or
    indentation to loop on, and costs the fewest tokens."""
    options = [tag(f'{{"name": {json.dumps(t["function"]["name"], ensure_ascii=False)}, "{args_key}": ',
                   json_format(parameters_schema(t)), "}") for t in tools]
    return options[0] if len(options) == 1 else {"type": "or", "elements": options}


def calls_array(tools: Sequence[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The elements of a non-empty JSON array of calls (exactly one without ``parallel``),
    separated by ``", "``, without the brackets. The number of calls is not bounded: any
    bound would refuse a legitimate batch, and a model that keeps adding calls until
    ``max_tokens`` still gets its complete calls back (the parsers keep them)."""
    one = call(tools)
    if not parallel:
        return one
    return {"type": "sequence", "elements": [
        one, {"type": "star", "content": {"type": "sequence", "elements": [const(", "), one]}}]}


def const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


def json_format(schema: dict[str, Any]) -> dict[str, Any]:
    # Bounded whitespace: a small model cannot spend its whole budget on newlines and
    # indentation inside a call (a known failure of unbounded JSON grammars; xgrammar's
    # structural-tag JSON has no fixed separators, and 1 is its smallest bound).
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


def any_text_except(markers: Sequence[str]) -> dict[str, Any]:
    return {"type": "any_text", "excludes": list(markers)}


def structural_tag(fmt: dict[str, Any]) -> str:
    return json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)
