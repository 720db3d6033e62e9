"""NATS subject names: ``weft.<kind>.<source>``, and who may speak on one.

The bus (nats_bus.py) publishes on ``subject(kind, source)`` and drops a received event
whose header claims a source other than its subject's (``addressed_from``), so the
NATS permission to publish on a subject (nats_auth.py) bounds whom a publisher can
speak for.
"""
from __future__ import annotations

import re

NAME_RE = re.compile(r"^[A-Za-z0-9_-]+$")


def subject(kind: str, source: str) -> str:
    """``weft.<kind>.<source>``; both parts must be subject-safe names."""
    for part, value in (("kind", kind), ("source", source)):
        if not NAME_RE.match(value):
            raise ValueError(f"{part} {value!r} must match {NAME_RE.pattern}")
    return f"weft.{kind}.{source}"


def addressed_from(subj: str, kind: str, source: str) -> bool:
    """Whether an event on ``subj`` may claim ``source``: only on its own subject."""
    return bool(NAME_RE.match(source)) and subj == f"weft.{kind}.{source}"
