"""The live settings and the shape of each one's value (services/mesh/live_settings.py).

``LIVE_SETTINGS`` names every setting that may change while the mesh runs, section by
section, with a check that returns None for a fine value and a sentence saying what is
wrong otherwise. These are shape checks, so a typo is a 400 at the router; the services
re-check their section with their own parsers. Pure functions: nothing here mutates.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from types import MappingProxyType

from services.shared.vocabulary import RUNG_LABELS

_NAME = r"[^\s=,:]+"
_COUNT = r"\d{1,18}"  # Python's int() refuses a string of over 4300 digits: the services would refuse it
_QUOTAS = re.compile(rf"^\s*({_NAME}\s*=\s*{_COUNT}\s*)(,\s*{_NAME}\s*=\s*{_COUNT}\s*)*$")
# No space around "=" or ":": the executor's parser (credit_audit.parse_partitions) refuses it.
_PARTITIONS = re.compile(rf"^\s*({_NAME}={_COUNT}:{_COUNT}\s*)(,\s*{_NAME}={_COUNT}:{_COUNT}\s*)*$")
_NUMBER = r"\d+(\.\d+)?"
_THRESHOLD = re.compile(rf"^\s*(\w+)\s*=\s*({_NUMBER}):({_NUMBER})\s*$")


def check_number(value: object, low: float = 0.0, high: float = math.inf, *, zero_ok: bool = True,
                 low_inclusive: bool = True) -> str | None:
    """None for a finite number in range, else what is wrong (bools are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return "must be a finite number"
    if value == 0 and zero_ok and low <= 0:
        return None
    if value < low or (value == low and not low_inclusive) or value > high:
        return f"must be in {'[' if low_inclusive else '('}{low:g}, {high:g}], got {value}"
    return None


def _choice(*choices: str) -> Callable[[object], str | None]:
    return lambda v: None if v in choices else f"must be one of {', '.join(choices)}, got {v!r}"


def _text(pattern: re.Pattern, example: str) -> Callable[[object], str | None]:
    def check(value: object) -> str | None:
        if not isinstance(value, str):
            return f"must be a string like {example!r}"
        if value.strip() and not pattern.match(value):
            return f"expected a value like {example!r}, got {value!r}"
        return None
    return check


def _rungs(value: object) -> str | None:
    if not isinstance(value, str):
        return "must be a comma-separated string of rungs"
    unknown = [r for r in (p.strip() for p in value.split(",")) if r and r not in RUNG_LABELS]
    return f"unknown rung(s) {', '.join(unknown)}; one of {', '.join(RUNG_LABELS)}" if unknown else None


def _thresholds(value: object) -> str | None:
    if not isinstance(value, str):
        return "must be a string like 'shed=0.95:0.75'"
    for item in filter(None, (p.strip() for p in value.split(","))):
        m = _THRESHOLD.match(item)
        if m is None or m.group(1) not in RUNG_LABELS or m.group(1) == "none":  # none has no thresholds
            return f"{item!r}: expected rung=enter:exit with a rung of {', '.join(RUNG_LABELS)}"
        enter, exit_ = float(m.group(2)), float(m.group(4))
        if enter > 1 or exit_ > enter:
            return f"{item!r}: need 0 <= exit <= enter <= 1"
    return None


def _partitions(value: object) -> str | None:
    problem = _text(_PARTITIONS, "acme=32:16,globex=32:8")(value)
    names = [item.partition("=")[0].strip() for item in value.split(",") if item.strip()] if not problem else []
    return problem or (f"a partition is named twice in {value!r}" if len(set(names)) != len(names) else None)


def _overcommit(value: object) -> str | None:
    problem = check_number(value)
    if problem is None and value != 0 and value < 1:
        return f"must be 0 (no cap by slots) or >= 1, got {value}"
    return problem


def _priority_weights(value: object) -> str | None:
    if not isinstance(value, str):
        return f"must be a string like 'las=0.5,aging_s=10', got {type(value).__name__}"
    from services.shared.priority_weights import parse_weight_overrides

    try:
        parse_weight_overrides(value)
    except ValueError as exc:
        return str(exc).removeprefix("priority_weights: ")
    return None


# section -> setting -> check (None: fine, else what is wrong). Only settings whose owner
# swaps a whole object for them while streams run; docs/live_config.md lists the rest.
LIVE_SETTINGS: Mapping[str, Mapping[str, Callable[[object], str | None]]] = MappingProxyType({
    "scheduler": MappingProxyType({
        "policy": _choice("weft", "fcfs", "priority"),
        "priority_weights": _priority_weights,
        "pause_policy": _choice("auto", "cost", "keep", "demote", "drop"),
        "prefill_ms_per_token": check_number,
        "block_second_ms": check_number,
        "transfer_ms_per_block": check_number,
        "default_tool_ms": check_number,
        "max_pinned_fraction": lambda v: check_number(v, 0.0, 1.0, zero_ok=False, low_inclusive=False),  # as pause.py
        "tenant_quotas": _text(_QUOTAS, "acme=64,globex=32"),
        "degradation_rungs": _rungs,
        "degradation_thresholds": _thresholds,
        "degradation_min_dwell_s": check_number,
        "executor_overcommit": _overcommit,
    }),
    "executor": MappingProxyType({
        "tenant_partitions": _partitions,
    }),
})
