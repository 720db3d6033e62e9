"""Shared helper of the streaming text filters: how much of a text's tail might be the
start of a marker, and so must be held back until the next delta decides."""
from __future__ import annotations

from collections.abc import Iterable


def partial_marker_suffix(text: str, markers: Iterable[str]) -> int:
    """Length of the longest proper suffix of ``text`` that is a prefix of a marker.

    ``partial_marker_suffix("abc<tool_", ["<tool_call>"]) == 6``; 0 when nothing is held.
    """
    held = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), held, -1):
            if text.endswith(marker[:k]):
                held = k
                break
    return held
