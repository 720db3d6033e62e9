"""An estimate of what the ``pattern`` regexes inside a JSON schema cost xgrammar to compile,
so that a schema which would hold a compile worker for many seconds is refused first.

Measured on SmolLM2's 49k vocabulary (xgrammar 0.2.9, 2 threads): a schema ``pattern``
compiles per bounded repetition it expands, ~0.6 ms per unit when flat (``[a-z]{3,90}`` is
90 units, ~50 ms) and ~5-10 ms per unit when one bounded repetition sits inside another
(``([a-z]{1,15}){1,15}``: 1.6 s; ``{1,30}){1,30}``: 9.5 s). 400 properties with
``[a-z]{3,90}`` (21 KB of schema) took 18 s. Each compile past its deadline keeps a worker
until xgrammar returns (native code cannot be interrupted), and busy workers refuse every
other tenant's new grammar: so the cost is bounded before compiling. (The ``regex`` and
``ebnf`` kinds compile the same repetitions natively in milliseconds: only schema patterns
are counted.)

Units: each atom counts 1; ``{m,n}`` multiplies what it repeats by n (m when unbounded),
and by ``NESTED_FACTOR`` more when that already held a bounded repetition. ``*``, ``+``,
``?`` do not expand. Patterns are strings under a ``pattern`` key, and the keys of
``patternProperties``.
"""
from __future__ import annotations

import re

NESTED_FACTOR = 10
MAX_PATTERN_UNITS = 2000  # ~1.3 s of compile idle, ~3 s beside decoding on 2 cores (deadline 5 s)
_QUANT = re.compile(r"\{(\d{1,9})(,(\d{0,9}))?\}")


def schema_pattern_units(doc: object) -> int:
    """Summed units of every pattern in a JSON document (walked iteratively)."""
    total, stack = 0, [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                total += pattern_units(node["pattern"])
            if isinstance(node.get("patternProperties"), dict):
                total += sum(pattern_units(k) for k in node["patternProperties"])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return total


def pattern_units(pattern: str) -> int:
    """Units of one regex (see the module docstring); malformed input is costed as far as
    it parses (xgrammar refuses it anyway)."""
    # each open group: [units so far, units of the last atom, whether the last atom holds a
    # bounded repetition, whether anything in the group does]
    stack: list[list] = [[0, 0, False, False]]
    i = 0
    while i < len(pattern):
        ch, frame = pattern[i], stack[-1]
        if ch == "\\":
            i = _atom(frame, 1, False, i + 2)
        elif ch == "[":
            end = _class_end(pattern, i)
            i = _atom(frame, 1, False, end + 1)
        elif ch == "(":
            stack.append([0, 0, False, False])
            i += 1
        elif ch == ")" and len(stack) > 1:
            inner = stack.pop()
            units, bounded = inner[0] + inner[1], inner[2] or inner[3]
            i = _atom(stack[-1], units, bounded, i + 1)
        elif ch == "{" and (m := _QUANT.match(pattern, i)):
            times = int(m.group(3) or m.group(1))  # {m,n} -> n; {m} and {m,} -> m
            factor = NESTED_FACTOR if frame[2] else 1
            frame[1] = frame[1] * max(times, 1) * factor
            frame[2] = frame[3] = True
            i = m.end()
        else:
            i = _atom(frame, 1, False, i + 1)
    while len(stack) > 1:  # unclosed groups
        inner = stack.pop()
        stack[-1][1] += inner[0] + inner[1]
    return stack[0][0] + stack[0][1]


def _atom(frame: list, units: int, bounded: bool, next_i: int) -> int:
    """Close the previous atom into the frame's sum and make ``units`` the last atom."""
    frame[0] += frame[1]
    frame[1], frame[2] = units, bounded
    return next_i


def _class_end(pattern: str, start: int) -> int:
    i = start + 1
    if i < len(pattern) and pattern[i] == "^":
        i += 1
    if i < len(pattern) and pattern[i] == "]":
        i += 1
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i
