"""The executor's live settings: its tenant partitions (``tenant_partitions``), from the
``executor`` section of the router's document (services/mesh/live_settings.py).

A new table replaces the pool's quota table between two engine steps (``set_partitions``
keeps every partition's usage; a lowered credit stops new borrowing, it frees nothing by
itself) and gets a fresh credit auditor. A table whose reservations exceed this pool is
refused (ValueError): the executor keeps the old table and its old settings version.
"""
from __future__ import annotations

import asyncio
from collections.abc import Mapping

import structlog

from services.executor.policy.credit_audit import CreditAuditor, parse_partitions

log = structlog.get_logger(__name__)


class PartitionTable:
    """The partition table in force and the auditor that decays its credit."""

    def __init__(self, async_engine, base_text: str) -> None:
        self.async_engine = async_engine
        self.base_text = base_text  # the --tenant-partitions flag: what an absent override means
        specs = parse_partitions(base_text)
        self.auditor: CreditAuditor | None = CreditAuditor(specs) if specs else None
        self._lock = asyncio.Lock()  # one table change at a time: an audit never undoes a live swap

    async def apply(self, overrides: Mapping[str, object]) -> None:
        """The follower's callback: the ``executor`` section's overrides."""
        unknown = sorted(set(overrides) - {"tenant_partitions"})
        if unknown:
            raise ValueError(f"{unknown[0]}: not a live executor setting")
        text = overrides.get("tenant_partitions", self.base_text)
        if not isinstance(text, str):
            raise ValueError("tenant_partitions: must be a string")
        specs = parse_partitions(text)
        async with self._lock:
            await self.async_engine.call(lambda e: e.set_partitions(list(specs)))  # ValueError: exceeds the pool
            self.auditor = CreditAuditor(specs) if specs else None
        log.info("executor_partitions_in_force", partitions={s.name: (s.reserved_blocks, s.credit_blocks)
                                                             for s in specs})

    async def audit_forever(self, period_s: float) -> None:
        """Every period: decay the credit of tenants that keep borrowing (credit_audit.py)."""
        while True:
            await asyncio.sleep(period_s)
            async with self._lock:
                if self.auditor is None:
                    continue
                usage = await self.async_engine.call(lambda e: e.pool.usage())
                result = self.auditor.audit(usage)
                await self.async_engine.call(lambda e: e.set_partitions(list(result.specs)))
            if result.decayed:
                log.info("credit_decayed", partitions=list(result.decayed),
                         credit_blocks={s.name: s.credit_blocks for s in result.specs})
