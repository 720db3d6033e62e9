"""Preemption and admission-order policies: who loses blocks, who is admitted next.

Policies are an enum + a small interface + a factory, so an ablation is a flag.
Priority reads "higher runs first" (services/shared/vocabulary.py): the waiting queue is
sorted ascending by ``queue_order_key`` and the victim is the sequence that sorts last.
A policy asks the KV manager questions (``is_borrowing``); it never touches the pool.
"""
from __future__ import annotations

import abc
import enum
from collections import deque
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from services.shared.vocabulary import queue_order_key

if TYPE_CHECKING:  # annotations only: the policy names load without torch (config, --help)
    from services.executor.engine.sequence import Sequence
    from services.executor.kv.manager import KVCacheManager


class PreemptionPolicyName(enum.Enum):
    FCFS = "fcfs"  # newest arrival loses (vLLM's default)
    PRIORITY = "priority"  # borrowers first, then the lowest priority, then the newest


class PreemptionPolicy(abc.ABC):
    @abc.abstractmethod
    def pick_victim(self, candidates: Seq[Sequence], kv: KVCacheManager) -> Sequence:
        """Choose the running sequence to preempt. ``candidates`` is never empty.
        Does not modify anything."""

    def order_waiting(self, waiting: deque[Sequence]) -> None:
        """Reorder the waiting queue in place before admission (default: leave FCFS)."""


class FcfsPolicy(PreemptionPolicy):
    def pick_victim(self, candidates: Seq[Sequence], kv: KVCacheManager) -> Sequence:
        return max(candidates, key=lambda s: s.arrival_time)


class PriorityPolicy(PreemptionPolicy):
    """Reclaims borrowed blocks first: a partition over its reserved share is the first
    to give back, so nobody's reservation is ever held hostage."""

    def pick_victim(self, candidates: Seq[Sequence], kv: KVCacheManager) -> Sequence:
        return max(
            candidates,
            key=lambda s: (kv.is_borrowing(s.partition), queue_order_key(s.priority), s.arrival_time),
        )

    def order_waiting(self, waiting: deque[Sequence]) -> None:
        if len(waiting) > 1:
            ordered = sorted(waiting, key=lambda s: (queue_order_key(s.priority), s.arrival_time))
            waiting.clear()
            waiting.extend(ordered)


def make_preemption_policy(name: str | PreemptionPolicyName) -> PreemptionPolicy:
    name = PreemptionPolicyName(name)
    return {PreemptionPolicyName.FCFS: FcfsPolicy, PreemptionPolicyName.PRIORITY: PriorityPolicy}[name]()


PREEMPTION_POLICIES: tuple[str, ...] = tuple(p.value for p in PreemptionPolicyName)
