"""Structured output requested in a body, as the ``Sampling.grammar`` the executor enforces.

The forms clients send, all mapped to one ``(kind, text)`` (``weft.v1.Grammar``):

    OpenAI   response_format {"type": "text"}                       -> None (free text)
             response_format {"type": "json_object"}                -> ("json_object", "")
             response_format {"type": "json_schema",
                              "json_schema": {"name", "schema", "strict"}} -> ("json_schema", schema JSON)
    vLLM     guided_json (object or JSON text), guided_regex, guided_grammar (EBNF),
             guided_choice [strings] -> a regex of the alternatives;
             structured_outputs {json | regex | grammar | choice} (its newer spelling)
    SGLang   json_schema (object or JSON text), regex, ebnf (top level)

At most one form per request: two are a 400 naming the second. The router checks shapes,
sizes and the JSON-schema keywords xgrammar would silently drop (``check_enforceable``:
a schema using ``not``, ``if``, ``contains``, a multi-entry ``allOf``... was compiled as if
the keyword were absent, and the output broke the schema the client asked for);
compiling is the executor's (xgrammar), whose refusal comes back as INVALID_ARGUMENT ``grammar.<kind>: ...`` and is answered naming the field the client
used (``GrammarRequest.field``, see ``delta_streams.name_grammar_errors``).
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.router.errors import InvalidRequestError
from services.router.json_fields import json_object, json_type

# A schema or grammar is compiled per request on the executor (cached by text): a bound
# on its size bounds that work. Generous for real schemas (OpenAI's own limit is 100
# properties and 5 levels of nesting).
MAX_GRAMMAR_CHARS = 65_536
MAX_CHOICES = 256
# vLLM's backend selector: Weft has one backend (xgrammar); naming another is refused.
_BACKENDS = (None, "auto", "xgrammar")
# vLLM's structured_outputs keys and guided_* fields -> grammar kind
_VLLM_KINDS = {"json": "json_schema", "regex": "regex", "grammar": "ebnf", "choice": "choice"}
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_grammar": "grammar", "guided_choice": "choice"}
_SGLANG = {"json_schema": "json_schema", "regex": "regex", "ebnf": "ebnf"}
_REGEX_SPECIAL = set("\\^$.|?*+()[]{}-/\"")
# Keywords xgrammar 0.2.9's schema converter ignores (or turns into "[]"/"{}" only): a
# schema using one is refused rather than enforced in part.
_UNENFORCED = ("not", "if", "then", "else", "contains", "minContains", "maxContains", "dependentSchemas",
               "dependentRequired", "unevaluatedProperties", "unevaluatedItems")
# Where a schema holds subschemas (everything else, "enum", "const", "default"..., is data).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_VALUES = ("additionalProperties", "additionalItems", "items", "propertyNames")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")


@dataclass(frozen=True)
class GrammarRequest:
    """A request's grammar and the body field it came from (named by every refusal)."""

    grammar: tuple[str, str]
    field: str


def parse_structured_output(body: Mapping[str, Any]) -> GrammarRequest | None:
    """The one grammar ``body`` asks for, or None; refuses bad shapes naming the field."""
    backend = body.get("guided_decoding_backend")
    if backend not in _BACKENDS:
        raise InvalidRequestError("guided_decoding_backend", f"is not supported ({backend!r}): the one backend "
                                  "is xgrammar; omit it")
    found: list[GrammarRequest] = []
    if body.get("response_format") is not None:
        g = _response_format(body["response_format"])
        if g is not None:
            found.append(GrammarRequest(g, "response_format"))
    for name, value in body.items():
        if not isinstance(name, str) or value is None or name == "guided_decoding_backend":
            continue
        if name.startswith("guided_"):
            if name not in _GUIDED:
                raise InvalidRequestError(name, "is not supported; guided decoding takes guided_json, "
                                          "guided_regex, guided_grammar or guided_choice")
            found.append(GrammarRequest(_vllm(_GUIDED[name], value, name), name))
        elif name in _SGLANG:
            found.append(GrammarRequest(_vllm_kind(_SGLANG[name], value, name), name))
    if body.get("structured_outputs") is not None:
        found.append(_structured_outputs(body["structured_outputs"]))
    if len(found) > 1:
        raise InvalidRequestError(found[1].field, f"only one structured-output form per request; "
                                  f"{found[0].field} is set too")
    return found[0] if found else None


def _response_format(value: Any) -> tuple[str, str] | None:
    rf = json_object(value, "response_format")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ("json_object", "")
    if kind == "json_schema":
        spec = json_object(rf.get("json_schema"), "response_format.json_schema")
        name = spec.get("name")
        if name is not None and (not isinstance(name, str) or not 0 < len(name) <= 64):
            raise InvalidRequestError("response_format.json_schema.name", "must be a string of 1 to 64 characters")
        if spec.get("strict") is not None and not isinstance(spec.get("strict"), bool):
            raise InvalidRequestError("response_format.json_schema.strict",
                                      f"must be a boolean, got {json_type(spec['strict'])}")
        if spec.get("schema") is None:
            raise InvalidRequestError("response_format.json_schema.schema", "is required")
        return ("json_schema", _schema_text(spec["schema"], "response_format.json_schema.schema"))
    raise InvalidRequestError("response_format.type", f"must be 'text', 'json_object' or 'json_schema', "
                              f"got {str(kind)[:40]!r}")


def _structured_outputs(value: Any) -> GrammarRequest:
    obj = json_object(value, "structured_outputs")
    set_keys = [k for k in _VLLM_KINDS if obj.get(k) is not None]
    unknown = [k for k, v in obj.items() if v is not None and k not in _VLLM_KINDS]
    if unknown:
        raise InvalidRequestError(f"structured_outputs.{str(unknown[0])[:40]}",
                                  f"is not supported; use one of {list(_VLLM_KINDS)}")
    if len(set_keys) != 1:
        raise InvalidRequestError("structured_outputs", f"must set exactly one of {list(_VLLM_KINDS)}")
    key = set_keys[0]
    field = f"structured_outputs.{key}"
    return GrammarRequest(_vllm(key, obj[key], field), field)


def _vllm(key: str, value: Any, field: str) -> tuple[str, str]:
    return _vllm_kind(_VLLM_KINDS[key], value, field)


def _vllm_kind(kind: str, value: Any, field: str) -> tuple[str, str]:
    if kind == "json_schema":
        if isinstance(value, str):  # JSON text, as vLLM and SGLang accept it
            try:
                value = json.loads(value)
            except (json.JSONDecodeError, RecursionError):
                raise InvalidRequestError(field, "is not valid JSON") from None
        return ("json_schema", _schema_text(value, field))
    if kind == "choice":
        return ("regex", choice_regex(value, field))
    if not isinstance(value, str) or not value.strip():
        got = "an empty string" if isinstance(value, str) else json_type(value)
        raise InvalidRequestError(field, f"must be a non-empty string, got {got}")
    _check_size(value, field)
    return (kind, value)


def _schema_text(schema: Any, field: str) -> str:
    """A JSON schema (an object, or ``true``: any JSON value) as compact JSON text."""
    if schema is True:
        return "{}"
    json_object(schema, field)
    try:
        text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except RecursionError:
        raise InvalidRequestError(field, "is nested too deeply") from None
    except ValueError:  # Python's json reads NaN / Infinity; JSON (and xgrammar) has neither
        raise InvalidRequestError(field, "holds NaN or Infinity, which JSON does not allow") from None
    _check_size(text, field)
    check_enforceable(schema, field)
    return text


def check_enforceable(schema: Any, field: str) -> None:
    """Refuse a schema (already size-checked) whose constraints xgrammar would not keep,
    naming the subschema's path; iterative, so any depth is safe."""
    stack = [(schema, field)]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue  # true / false / a malformed subschema: xgrammar's own check answers
        for key in _UNENFORCED:
            if key in node:
                raise InvalidRequestError(f"{path}.{key}", "is not enforced by the grammar engine (xgrammar); "
                                          "express the constraint without it")
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            raise InvalidRequestError(f"{path}.allOf", "with more than one subschema is not enforced by the "
                                      "grammar engine; merge them into one schema")
        for key in ("anyOf", "oneOf", "type"):
            if node.get(key) == []:
                raise InvalidRequestError(f"{path}.{key}", "must not be empty (no value could match)")
        stack.extend(_subschemas(node, path))


def check_tool_schemas(tools: Any, field_format: str) -> None:
    """Each tool's parameters as ``_schema_text`` checks a schema (a tool grammar embeds
    them); ``field_format`` names tool i, e.g. ``"tools[{}].function.parameters"``."""
    for i, tool in enumerate(tools or ()):
        params = tool.get("function", {}).get("parameters")
        if isinstance(params, dict):
            _schema_text(params, field_format.format(i))


def _subschemas(node: dict, path: str) -> list[tuple[Any, str]]:
    out = []
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            out.extend((sub, f"{path}.{key}.{str(name)[:40]}") for name, sub in node[key].items())
    out.extend((node[key], f"{path}.{key}") for key in _SCHEMA_VALUES if isinstance(node.get(key), dict))
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            out.extend((sub, f"{path}.{key}[{i}]") for i, sub in enumerate(node[key]))
    return out


def choice_regex(choices: Any, field: str) -> str:
    """A regex matching exactly one of ``choices`` (vLLM's guided_choice)."""
    if not isinstance(choices, list) or not choices:
        raise InvalidRequestError(field, "must be a non-empty array of strings")
    if len(choices) > MAX_CHOICES:
        raise InvalidRequestError(field, f"at most {MAX_CHOICES} choices, got {len(choices)}")
    for i, c in enumerate(choices):
        if not isinstance(c, str) or not c:
            raise InvalidRequestError(f"{field}[{i}]", "must be a non-empty string")
    text = "(" + "|".join("".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in c) for c in choices) + ")"
    _check_size(text, field)
    return text


def _check_size(text: str, field: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise InvalidRequestError(field, f"at most {MAX_GRAMMAR_CHARS} characters, got {len(text)}")
