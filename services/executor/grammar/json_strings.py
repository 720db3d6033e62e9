r"""JSON strings that stay valid JSON under xgrammar 0.2.9.

Three gaps in xgrammar 0.2.9's JSON-schema conversion: two let a constrained output stop
being JSON, one drops a constraint (found with the real matcher over SmolLM2's vocabulary;
tests/unit/executor/test_grammar_strings.py):

- A string with ``minLength`` / ``maxLength`` (and a ``propertyNames`` length) becomes a
  repetition of ``[^"\\\r\n]``: every other control character (U+0000-U+001F: TAB, \x04)
  is allowed raw, which JSON forbids, and escapes are not allowed at all. A plain
  ``{"type": "string"}`` is right (xgrammar's ``basic_string``). ``safe_string_chars``
  rewrites the converted grammar so each counted character is a JSON-safe character or one
  escape, with the same bounds (an escape counts as one character of the decoded string;
  a surrogate pair ``\uD83D\uDE00`` counts two).
- A ``pattern`` (or ``patternProperties`` key) is matched against the raw JSON text, not
  the decoded string, and nothing escapes what it names: ``\t``, ``\x04``, ``"`` or
  ``\\`` in a pattern put a raw control character, an unescaped quote or a lone backslash
  in the output. ``.``, negated classes, ``\s`` / ``\S`` / ``\W`` and ranges such as
  ``[ -~]`` are safe (xgrammar leaves these characters out). A rewrite of the regex would
  have to escape inside classes and alternations, so ``check_string_patterns`` refuses such
  a pattern, naming its keyword path, instead of producing invalid JSON.
- Beside a ``pattern``, or a ``format`` xgrammar knows (``date``, ``email``, ...),
  ``minLength`` / ``maxLength`` are silently dropped: refused too, naming the keyword,
  rather than enforced in part (the bounds can go into the pattern). Only for the
  ``json_schema`` kind: the router decides that for tool grammars.
"""
from __future__ import annotations

import re

import xgrammar as xgr

from services.executor.errors import InvalidRequestError

# A length-bounded string's character rule as xgrammar 0.2.9 prints it.
_UNSAFE_CHARS_RULE = re.compile(r'^(\S+) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.M)
# Each such rule becomes a reference to one shared rule: with "class or escape" written
# inline in each, 200 strings of maxLength 255 took 0.5-2 s to compile instead of ~40 ms.
_CHAR_RULE, _ESCAPE_RULE = "weft_json_string_char", "weft_json_string_escape"
_SAFE_RULES = (
    _CHAR_RULE + ' ::= ([^\\0-\\x1f\\"\\\\]) | ("\\\\" ' + _ESCAPE_RULE + ')\n'
    + _ESCAPE_RULE + ' ::= ([\\"\\\\/bfnrt]) | ("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9])\n')

# What a pattern must not name outside a negated class: a control character, a quote or a backslash.
_CONTROL_ESCAPES = set("tnrfva0e")
# Formats xgrammar 0.2.9 compiles to their own grammar, dropping minLength / maxLength beside
# them (probed: a "characters{m,n}" rule only appears for the other formats).
_FORMATS_OVERRIDING_LENGTH = frozenset((
    "date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uri-reference",
    "uuid", "uri-template", "json-pointer", "relative-json-pointer"))
_HEX = re.compile(r"x([0-9a-fA-F]{2})|x\{([0-9a-fA-F]{1,6})\}|u([0-9a-fA-F]{4})")


def safe_string_chars(grammar: xgr.Grammar) -> xgr.Grammar:
    """``grammar`` with every length-bounded string character rule made JSON-safe (itself
    when it has none)."""
    text = str(grammar)
    fixed, count = _UNSAFE_CHARS_RULE.subn(lambda m: f"{m.group(1)} ::= (({_CHAR_RULE}))", text)
    if not count:
        return grammar
    # from_json_schema and from_structural_tag both name their root rule "root"
    return xgr.Grammar.from_ebnf(f"{fixed}\n{_SAFE_RULES}")


def check_string_patterns(doc: object, kind: str) -> None:
    """Raise InvalidRequestError naming ``grammar.<kind>`` and the keyword path of the first
    ``pattern`` / ``patternProperties`` key that can emit an unescaped character, or of a
    length xgrammar would drop."""
    roots = [(doc, "")] if kind == "json_schema" else list(_embedded_schemas(doc, ""))
    for schema, base in roots:
        for node, path in _nodes(schema, base):
            _check_node(node, path, f"grammar.{kind}", lengths=kind == "json_schema")


def _check_node(node: dict, path: str, field: str, lengths: bool) -> None:
    """``lengths``: refuse a dropped length too. Not inside a structural tag: that is a tool
    grammar, and the router lets tools of ``tool_choice: auto`` through with keywords
    xgrammar drops (it refuses them for a forced tool)."""
    patterns = [(node["pattern"], _join(path, "pattern"))] if isinstance(node.get("pattern"), str) else []
    if isinstance(node.get("patternProperties"), dict):
        patterns += [(key, _join(path, f"patternProperties[{key!r}]")) for key in node["patternProperties"]]
    for pattern, where in patterns:
        bad = unsafe_pattern_char(pattern)
        if bad is not None:
            raise InvalidRequestError(field, f"{where} names {bad}, which xgrammar would write into the JSON "
                                      "string unescaped (invalid JSON); leave quotes, backslashes and control "
                                      "characters out of the pattern")
    fmt = node.get("format")
    if not lengths:
        return
    beside = "pattern" if isinstance(node.get("pattern"), str) else \
        "format" if isinstance(fmt, str) and fmt in _FORMATS_OVERRIDING_LENGTH else None
    for key in ("minLength", "maxLength"):
        if beside and key in node:
            raise InvalidRequestError(field, f"{_join(path, key)} beside {beside} is not enforced by the grammar "
                                      f"engine (xgrammar keeps only the {beside}); "
                                      + ("put the bounds in the pattern, e.g. [a-z]{1,20}" if beside == "pattern"
                                         else "drop the length or the format"))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _embedded_schemas(node: object, path: str):
    """The JSON schemas inside a structural tag (its ``json_schema`` values)."""
    stack = [(node, path)]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "json_schema" and isinstance(value, (dict, bool)):
                    yield value, _join(path, key)
                else:
                    stack.append((value, _join(path, key)))
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node))


def _nodes(schema: object, path: str):
    """Every object in a schema document with its path (walked iteratively)."""
    stack = [(schema, path)]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            yield node, path
            stack.extend((v, _join(path, str(k))) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node))


def unsafe_pattern_char(pattern: str) -> str | None:
    """A description of the first character ``pattern`` names that JSON needs escaped
    (outside a negated class), or None. Conservative: a range starting at one counts."""
    i, negated_depth = 0, None  # negated_depth: inside a negated class ("[^...]")
    in_class = False
    while i < len(pattern):
        ch = pattern[i]
        if ch == "[" and not in_class:
            in_class, negated_depth = True, pattern.startswith("[^", i)
            i += 2 if negated_depth else 1
            continue
        if ch == "]" and in_class:
            in_class = False
            i += 1
            continue
        safe_here = in_class and negated_depth
        if ch == "\\":
            bad, i = _escape(pattern, i + 1, in_class)
        else:
            bad, i = _literal(ch), i + 1
        if bad is not None and not safe_here:
            return bad
    return None


def _literal(ch: str) -> str | None:
    if ch == '"':
        return "a quote"
    if ord(ch) < 0x20:
        return f"control character U+{ord(ch):04X}"
    return None


def _escape(pattern: str, i: int, in_class: bool) -> tuple[str | None, int]:
    """What the escape at ``pattern[i]`` (just after the backslash) names, and where it ends."""
    if i >= len(pattern):
        return None, i
    ch = pattern[i]
    if ch == "\\":
        return "a backslash", i + 1
    if ch in _CONTROL_ESCAPES or (ch == "b" and in_class):  # [\b] is backspace
        return f"the control character \\{ch}", i + 1
    if ch == "c":
        return "a control character (\\c)", i + 2
    m = _HEX.match(pattern, i)
    if m:
        code = int(next(g for g in m.groups() if g), 16)
        bad = "a backslash" if code == 0x5C else _literal(chr(code)) if code < 0x110000 else None
        return bad, m.end()
    return _literal(ch), i + 1  # \" is a quote; other escapes (\d, \s, \.) are safe
