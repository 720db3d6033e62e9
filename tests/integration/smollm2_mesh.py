"""Shared by the issue-15 acceptance modules: SmolLM2-135M-Instruct served by a real mesh
(`weft up` as a subprocess, real NATS, real service processes) with an API key, and a small
JSON Schema validator for what the model returns.

``smollm2_mesh`` is a context manager a module-scoped fixture wraps: one mesh per module.
``schema_errors(value, schema)`` covers the JSON Schema keywords the tests' schemas use
(type, properties, required, additionalProperties, items, enum, const, min/max bounds, $ref
to $defs as pydantic writes them) and returns a list of "path: problem" strings, empty when
the value conforms. It is written here because ``jsonschema`` is not a dependency; it
refuses a schema keyword it does not know instead of silently passing it.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

from tests.integration.launched_mesh import launched_mesh
from weft.models.sources import resolve_model

MODEL = "smollm2-135m-instruct"
API_KEY = "sk-agent-io"


@dataclass(frozen=True)
class SmolMesh:
    http_url: str
    model_dir: Path
    api_key: str = API_KEY
    model: str = MODEL

    @property
    def base_url(self) -> str:
        return f"{self.http_url}/v1"

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0, timeout=120)


@contextmanager
def smollm2_mesh(state_dir: Path) -> Iterator[SmolMesh]:
    """The real SmolLM2 checkpoint (pulled into the model cache once) behind one executor."""
    model_dir = resolve_model(MODEL, progress=False)
    keys = state_dir / "keys.txt"
    keys.write_text(f"{API_KEY} acme\n")
    env = {"WEFT_EXECUTOR_NUM_THREADS": "2"}
    with launched_mesh(state_dir, model_dir, 1, env, ["--keys-file", str(keys)], timeout_s=180) as (_, state):
        yield SmolMesh(state.http_url, model_dir)


# -- a small JSON Schema validator ----------------------------------------------------------
_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}
# Keywords that only annotate: they never make a value invalid.
_ANNOTATIONS = {"title", "description", "default", "examples", "$defs", "definitions", "$schema"}


def schema_errors(value: Any, schema: dict, path: str = "$", root: dict | None = None) -> list[str]:
    root = root if root is not None else schema
    if "$ref" in schema:
        return schema_errors(value, _resolve(schema["$ref"], root), path, root)
    unknown = set(schema) - _ANNOTATIONS - set(_CHECKS)
    if unknown:
        raise ValueError(f"{path}: schema keyword(s) the test validator does not know: {sorted(unknown)}")
    errors: list[str] = []
    for keyword, check in _CHECKS.items():
        if keyword in schema:
            errors += check(value, schema, path, root)
    return errors


def _resolve(ref: str, root: dict) -> dict:
    node: Any = root
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return node


def _type(value, schema, path, root):
    names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    return [] if any(_TYPES[n](value) for n in names) else [f"{path}: {value!r} is not of type {names}"]


def _properties(value, schema, path, root):
    if not isinstance(value, dict):
        return []
    errors = []
    for name, sub in schema["properties"].items():
        if name in value:
            errors += schema_errors(value[name], sub, f"{path}.{name}", root)
    extra = sorted(set(value) - set(schema["properties"]))
    allowed = schema.get("additionalProperties", True)
    if allowed is False and extra:
        errors.append(f"{path}: unexpected properties {extra}")
    elif isinstance(allowed, dict):
        errors += [e for name in extra for e in schema_errors(value[name], allowed, f"{path}.{name}", root)]
    return errors


def _required(value, schema, path, root):
    missing = [n for n in schema["required"] if isinstance(value, dict) and n not in value]
    return [f"{path}: missing required {missing}"] if missing else []


def _items(value, schema, path, root):
    if not isinstance(value, list):
        return []
    return [e for i, item in enumerate(value) for e in schema_errors(item, schema["items"], f"{path}[{i}]", root)]


def _any_of(value, schema, path, root):
    options = schema.get("anyOf") or schema.get("oneOf")
    if any(not schema_errors(value, option, path, root) for option in options):
        return []
    return [f"{path}: {value!r} matches none of {options}"]


def _bound(keyword: str, measure, ok) -> Any:
    def check(value, schema, path, root):
        size = measure(value)
        if size is None or ok(size, schema[keyword]):
            return []
        return [f"{path}: {value!r} violates {keyword}={schema[keyword]}"]
    return check


def _number(value):
    return value if _TYPES["number"](value) else None


_CHECKS = {
    "type": _type,
    "properties": _properties,
    "additionalProperties": lambda v, s, p, r: [],  # checked with properties
    "required": _required,
    "items": _items,
    "anyOf": _any_of,
    "oneOf": _any_of,
    "enum": lambda v, s, p, r: [] if v in s["enum"] else [f"{p}: {v!r} not in enum {s['enum']}"],
    "const": lambda v, s, p, r: [] if v == s["const"] else [f"{p}: {v!r} != const {s['const']!r}"],
    "minItems": _bound("minItems", lambda v: len(v) if isinstance(v, list) else None, lambda n, b: n >= b),
    "maxItems": _bound("maxItems", lambda v: len(v) if isinstance(v, list) else None, lambda n, b: n <= b),
    "minLength": _bound("minLength", lambda v: len(v) if isinstance(v, str) else None, lambda n, b: n >= b),
    "maxLength": _bound("maxLength", lambda v: len(v) if isinstance(v, str) else None, lambda n, b: n <= b),
    "minimum": _bound("minimum", _number, lambda n, b: n >= b),
    "maximum": _bound("maximum", _number, lambda n, b: n <= b),
}
