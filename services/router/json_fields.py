"""Typed access to fields of a decoded JSON body; errors name the field."""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from services.router.errors import InvalidRequestError


def json_object(value: Any, field: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidRequestError(field, f"must be a JSON object, got {json_type(value)}")
    return value


def json_type(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null",
            int: "integer", float: "number"}.get(type(value), type(value).__name__)


def optional_field(body: Mapping[str, Any], field: str, kind: type, default: Any) -> Any:
    """An optional field of one JSON type (``null`` reads as absent; bools are not ints)."""
    value = body.get(field)
    if value is None:
        return default
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok:
        want = {bool: "a boolean", int: "an integer", float: "a finite number", str: "a string"}[kind]
        got = repr(value) if isinstance(value, float) else json_type(value)  # nan/inf, not "number"
        raise InvalidRequestError(field, f"must be {want}, got {got}")
    return value
