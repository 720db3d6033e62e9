"""Tenant partitions from a flag, and the periodic credit audit that decays borrowing.

NOTE: a partition's ``credit_blocks`` is what it may borrow beyond its reservation.
Borrowing is fine while nobody else needs the memory, but a tenant that keeps
borrowing audit after audit slowly loses credit (×``decay`` per period, never below
``min_credit_fraction`` of its configured credit), and regains it (×1/decay) once it
stops. Lowering the credit never frees blocks by itself: it stops new borrowing, and
the ``priority`` preemption policy reclaims borrowers first when someone with a
reservation needs blocks. A reservation is never decayed.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from services.executor.kv.block_pool import PartitionSpec, PartitionUsage


def parse_partitions(text: str) -> list[PartitionSpec]:
    """``"acme=32:16,globex=32:8"`` → PartitionSpecs (name=reserved:credit); raises ValueError."""
    specs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, quota = item.partition("=")
        reserved, sep2, credit = quota.partition(":")
        if not sep or not sep2 or not name or not reserved.isdigit() or not credit.isdigit():
            raise ValueError(f"partition {item!r}: expected name=reserved:credit with block counts")
        specs.append(PartitionSpec(name.strip(), int(reserved), int(credit)))
    if len({s.name for s in specs}) != len(specs):
        raise ValueError("a partition is named twice")
    return specs


@dataclass(frozen=True)
class AuditResult:
    specs: tuple[PartitionSpec, ...]  # the quota table to apply now
    decayed: tuple[str, ...]  # partitions whose credit shrank this period


class CreditAuditor:
    """Pure: ``audit(usage)`` returns the next quota table; it modifies nothing else."""

    def __init__(self, configured: Sequence[PartitionSpec], decay: float = 0.8,
                 min_credit_fraction: float = 0.25) -> None:
        if not 0 < decay <= 1 or not 0 <= min_credit_fraction <= 1:
            raise ValueError("decay must be in (0, 1] and min_credit_fraction in [0, 1]")
        self.configured = {s.name: s for s in configured}
        self.decay = decay
        self.min_credit_fraction = min_credit_fraction
        self._credit = {s.name: float(s.credit_blocks) for s in configured}

    def audit(self, usage: Sequence[PartitionUsage]) -> AuditResult:
        used = {u.name: u for u in usage}
        decayed = []
        specs = []
        for name, spec in self.configured.items():
            u = used.get(name)
            borrowing = u is not None and u.used_blocks > spec.reserved_blocks
            floor = spec.credit_blocks * self.min_credit_fraction
            if borrowing:
                new = max(floor, self._credit[name] * self.decay)
                if int(new) < int(self._credit[name]):
                    decayed.append(name)
            else:
                new = min(float(spec.credit_blocks), max(self._credit[name], 1.0) / self.decay)
            self._credit[name] = new
            specs.append(replace(spec, credit_blocks=int(new)))
        return AuditResult(tuple(specs), tuple(decayed))
