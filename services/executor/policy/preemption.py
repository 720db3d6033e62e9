"""Preemption and admission-order policies: who loses blocks, who is admitted next.

Policies are an enum + a small interface + a factory, so an ablation is a flag.
"""
from __future__ import annotations

import abc
import enum
from collections import deque
from collections.abc import Sequence as Seq

from services.executor.kv.block_pool import BlockPool
from services.executor.engine.sequence import Sequence


class PreemptionPolicyName(enum.Enum):
    FCFS = "fcfs"  # newest arrival loses (vLLM's default)
    PRIORITY = "priority"  # borrowers first, then the lowest priority, then the newest


class PreemptionPolicy(abc.ABC):
    @abc.abstractmethod
    def pick_victim(self, candidates: Seq[Sequence], pool: BlockPool) -> Sequence:
        """Choose the running sequence to preempt. ``candidates`` is never empty.
        Does not modify anything."""

    def order_waiting(self, waiting: deque[Sequence]) -> None:
        """Reorder the waiting queue in place before admission (default: leave FCFS)."""


class FcfsPolicy(PreemptionPolicy):
    def pick_victim(self, candidates: Seq[Sequence], pool: BlockPool) -> Sequence:
        return max(candidates, key=lambda s: s.arrival_time)


class PriorityPolicy(PreemptionPolicy):
    """Reclaims borrowed blocks first: a partition over its reserved share is the first
    to give back, so nobody's reservation is ever held hostage."""

    def pick_victim(self, candidates: Seq[Sequence], pool: BlockPool) -> Sequence:
        return max(
            candidates,
            key=lambda s: (pool.borrowed_blocks(s.partition) > 0, s.priority, s.arrival_time),
        )

    def order_waiting(self, waiting: deque[Sequence]) -> None:
        if len(waiting) > 1:
            ordered = sorted(waiting, key=lambda s: (s.priority, s.arrival_time))
            waiting.clear()
            waiting.extend(ordered)


def make_preemption_policy(name: str | PreemptionPolicyName) -> PreemptionPolicy:
    name = PreemptionPolicyName(name)
    return {PreemptionPolicyName.FCFS: FcfsPolicy, PreemptionPolicyName.PRIORITY: PriorityPolicy}[name]()
