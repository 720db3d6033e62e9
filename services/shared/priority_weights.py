"""``--priority-weights``: the weft policy's term weights as ``name=value`` text.

Pure (no torch, no service imports): the scheduler builds its ``WeftWeights`` from it and
the live-settings document (services/mesh/live_settings.py) checks a PATCH with it.
"""
from __future__ import annotations

import math

WEIGHT_NAMES = ("las", "slack", "fresh", "entropy", "aging_s")


def parse_weight_overrides(text: str) -> dict[str, float]:
    """``"las=0.5,aging_s=10"`` -> ``{"las": 0.5, "aging_s": 10.0}`` (``""``: none). ValueError
    naming the item: unknown names, non-numbers, negative weights, aging_s <= 0."""
    values: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or name not in WEIGHT_NAMES:
            raise ValueError(f"priority_weights: {item!r} is not one of {', '.join(n + '=W' for n in WEIGHT_NAMES)}")
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"priority_weights: {item!r}: {raw.strip()!r} is not a number") from None
        if not math.isfinite(value) or value < 0 or (name == "aging_s" and value == 0):
            raise ValueError(f"priority_weights: {item!r}: must be a finite number >= 0 (aging_s > 0)")
        values[name] = value
    return values
