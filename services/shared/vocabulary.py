"""The words every service must agree on: request classes, degradation rungs, priority,
and the KV partition a request is charged to.

NOTE: each vocabulary is written once, here. The proto enums (``weft.v1.RequestClass``,
``weft.v1.DegradationRung``) are the wire form of the same words; each service's
``server.py`` converts between them and these, and nothing else spells them out.

Priority has ONE convention end to end: **higher runs first**. The router's caller
priority, the scheduler's dynamic priority, the executor's queue order and the
cachestore's demotion hint all read it that way; the only place a sign is taken is
``queue_order_key``, where a queue that sorts ascending asks for its key.
"""
from __future__ import annotations

import enum


class RequestClass(enum.Enum):
    """Service class of a request; drives admission, priority and contracts."""

    INTERACTIVE = "interactive"  # a person waits for the first token
    AGENTIC = "agentic"  # one hop of an agent program
    DETERMINISTIC = "deterministic"  # must reproduce (risk checks): no batch-dependent numerics
    BATCH = "batch"  # best effort

    @classmethod
    def parse(cls, text: str) -> RequestClass:
        try:
            return cls(text.strip().lower())
        except ValueError:
            raise ValueError(f"unknown request class {text!r}; known: {REQUEST_CLASS_LABELS}") from None


REQUEST_CLASS_LABELS: tuple[str, ...] = tuple(c.value for c in RequestClass)


class Rung(enum.IntEnum):
    """A step of the degradation ladder, cheapest quality loss first.

        none → kv_int8 → kv_compress → smaller_model → shed
    """

    NONE = 0
    KV_INT8 = 1
    KV_COMPRESS = 2
    SMALLER_MODEL = 3
    SHED = 4

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> Rung:
        try:
            return cls[text.strip().upper()]
        except KeyError:
            raise ValueError(f"unknown degradation rung {text!r}; known: {list(RUNG_LABELS)}") from None


RUNG_LABELS: tuple[str, ...] = tuple(r.label for r in Rung)
# Rungs an executor pool can serve (``--serves-rung``): shedding is the scheduler's, not a pool's.
POOL_RUNG_LABELS: tuple[str, ...] = tuple(r.label for r in Rung if r is not Rung.SHED)


def queue_order_key(priority: float) -> float:
    """The ascending sort key of a request with ``priority`` (higher runs first)."""
    return -priority


DEFAULT_PARTITION = "default"


def partition_of(partition: str, tenant_salt: str) -> str:
    """The KV partition a request is charged to: the one it names, else its tenant's,
    else the shared default one."""
    return partition or tenant_salt or DEFAULT_PARTITION
