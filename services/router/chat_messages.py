"""Chat messages and tools of ``/v1/chat/completions``, validated into the plain dicts
the chat template expects (role, content text, tool_calls with parsed arguments,
tool_call_id, name). Rejections name the field (``messages[2].tool_calls[0].function``).

An assistant message that only calls tools may leave ``content`` null or absent (OpenAI's
own clients send ``null``); the template gets ``""`` then. Templates test content for truth
before rendering it beside tool calls, so ``""`` reads as "no text" to them, while one that
concatenates ``message['content']`` unconditionally (SmolLM2's GGUF template) renders
instead of failing on the missing key, which the router answered with a 400."""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from services.router.errors import InvalidRequestError
from services.router.json_fields import json_object, json_type, optional_field
from services.router.tool_parsers import ToolChoice

ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CHOICES = ("none", "auto", "required")
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names


def text_content(value: Any, field: str, allow_null: bool) -> str | None:
    if value is None:
        if allow_null:
            return None
        raise InvalidRequestError(field, "is required")
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for i, part in enumerate(value):
            part = json_object(part, f"{field}[{i}]")
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"{field}[{i}]", "only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequestError(field, f"must be a string or an array of text parts, got {json_type(value)}")


def parse_message(value: Any, field: str) -> dict[str, Any]:
    m = json_object(value, field)
    role = m.get("role")
    if role not in ROLES:
        raise InvalidRequestError(f"{field}.role", f"must be one of {list(ROLES)}, got {role!r}")
    tool_calls = m.get("tool_calls")
    if tool_calls is not None and role != "assistant":  # was dropped silently: the caller's mistake
        raise InvalidRequestError(f"{field}.tool_calls", f"only assistant messages carry tool_calls, not {role!r}")
    content = text_content(m.get("content"), f"{field}.content", allow_null=bool(tool_calls))
    out: dict[str, Any] = {"role": "system" if role == "developer" else role,
                           "content": "" if content is None else content}
    if m.get("name") is not None:
        out["name"] = _string(m, "name", field)
    if role == "tool":
        out["tool_call_id"] = _string(m, "tool_call_id", field)
        if out["tool_call_id"] is None:
            raise InvalidRequestError(f"{field}.tool_call_id", "is required for role 'tool'")
    if tool_calls is not None:
        out["tool_calls"] = _assistant_tool_calls(tool_calls, f"{field}.tool_calls")
    return out


def _string(m: Mapping[str, Any], key: str, field: str) -> str | None:
    """``m[key]`` as an optional string; the error names ``messages[i].key``, not ``key``."""
    try:
        return optional_field(m, key, str, None)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{field}.{key}", exc.message) from None


def _assistant_tool_calls(value: Any, field: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise InvalidRequestError(field, f"must be an array, got {json_type(value)}")
    calls = []
    for i, call in enumerate(value):
        call = json_object(call, f"{field}[{i}]")
        if call.get("type", "function") != "function":
            raise InvalidRequestError(f"{field}[{i}].type", f"must be 'function', got {call.get('type')!r}")
        call_id = _string(call, "id", f"{field}[{i}]")
        fn = json_object(call.get("function"), f"{field}[{i}].function")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"{field}[{i}].function.name", "must be a non-empty string")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            # Templates render arguments with ``tojson``: hand them the object, not its text.
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass
            except RecursionError:  # a RuntimeError, not a ValueError: was an HTTP 500
                raise InvalidRequestError(f"{field}[{i}].function.arguments", "JSON nested too deeply") from None
        calls.append({"id": call_id or f"call_{i}", "type": "function",
                      "function": {"name": name, "arguments": args}})
    return calls


def parse_tools(value: Any) -> tuple[dict[str, Any], ...] | None:
    """The request's ``tools`` as ``{"type": "function", "function": {...}}`` dicts: names
    as OpenAI allows them (they are spelled into grammars and parsed back), distinct, and
    ``parameters``, when given, a JSON object schema."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise InvalidRequestError("tools", f"must be an array, got {json_type(value)}")
    tools, names = [], set()
    for i, tool in enumerate(value):
        tool = json_object(tool, f"tools[{i}]")
        if tool.get("type", "function") != "function":
            raise InvalidRequestError(f"tools[{i}].type", "only 'function' tools are supported")
        fn = json_object(tool.get("function"), f"tools[{i}].function")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise InvalidRequestError(f"tools[{i}].function.name",
                                      "must be 1 to 64 letters, digits, underscores or dashes")
        if name in names:
            raise InvalidRequestError(f"tools[{i}].function.name", f"{name!r} names two tools")
        names.add(name)
        if fn.get("parameters") is not None:
            params = json_object(fn["parameters"], f"tools[{i}].function.parameters")
            if params.get("type", "object") != "object":
                raise InvalidRequestError(f"tools[{i}].function.parameters",
                                          f"must be an object schema (type 'object'), got type {params['type']!r}")
        tools.append({"type": "function", "function": dict(fn)})
    return tuple(tools)


def parse_tool_choice(value: Any, tools: tuple[dict[str, Any], ...] | None) -> Any:
    """Legacy shape ("none" | "auto" | "required" | the request's object), kept while the
    doors compare it with strings; new code takes ``parse_tool_choice_spec``."""
    spec = parse_tool_choice_spec(value, tools)
    return dict(value) if spec.mode == "function" else spec.mode


def parse_tool_choice_spec(value: Any, tools: tuple[dict[str, Any], ...] | None) -> ToolChoice:
    """``tool_choice`` as a ``ToolChoice``: absent is "auto" with tools, "none" without;
    "required" or a named function need tools (the function among them)."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise InvalidRequestError("tool_choice", f"must be one of {list(TOOL_CHOICES)} or an object")
        if value == "required" and not tools:
            raise InvalidRequestError("tool_choice", "'required' needs tools")
        return ToolChoice(value)
    choice = json_object(value, "tool_choice")
    if choice.get("type", "function") != "function":
        raise InvalidRequestError("tool_choice.type", f"must be 'function', got {choice.get('type')!r}")
    name = choice.get("function", {}).get("name") if isinstance(choice.get("function"), Mapping) else None
    if not tools or not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
        raise InvalidRequestError("tool_choice", f"names function {name!r}, which is not in tools")
    return ToolChoice("function", name)
