"""Where a JSON value ends in text that is still arriving: the formats' parsers use it to
tell a marker inside a JSON string (``"see </tool_call> here"``) from the marker that
closes a call, and to take the complete elements of a call array that was cut short.

The scan tracks only strings (with their escapes) and bracket depth; it does not validate.
Whoever takes the value parses it (``json.loads``), so malformed text is still refused.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

_SIGNIFICANT = re.compile(r'["\\{}\[\]]')  # all the scan looks at; the rest is skipped at C speed


def value_end(text: str, pos: int) -> int | None:
    """The index just past the object or array that starts at ``text[pos]``; None while the
    text ends inside it. ``text[pos]`` must be ``{`` or ``[``."""
    depth, in_string, escaped_at = 0, False, -1
    for m in _SIGNIFICANT.finditer(text, pos):
        ch, i = m.group(), m.start()
        if in_string:
            if i == escaped_at:
                continue
            if ch == "\\":
                escaped_at = i + 1
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def loads(text: str) -> Any:
    """``json.loads``, with None for what does not parse (nesting too deep included)."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


def complete_elements(text: str, pos: int, take: Callable[[Any], Any]) -> tuple[list[Any], int, str]:
    """The elements of the array whose ``[`` is at ``text[pos]``, each turned into an item by
    ``take`` (None refuses it), as far as they are complete and taken; the index where the
    scan stopped; and why: "done" (just past the ``]``), "more" (the text ends inside the
    array) or "bad" (at something that is not an element, or one ``take`` refused)."""
    items: list[Any] = []
    i = skip_space(text, pos + 1)
    while i < len(text):
        if text[i] == "]":
            return items, i + 1, "done"
        if items and text[i] == ",":
            i = skip_space(text, i + 1)
            continue
        if text[i] != "{":
            return items, i, "bad"
        end = value_end(text, i)
        if end is None:
            return items, i, "more"
        item = take(loads(text[i:end]))
        if item is None:
            return items, i, "bad"
        items.append(item)
        i = skip_space(text, end)
    return items, i, "more"
