"""Iteration-level batch scheduling inside one executor.

NOTE: there is no prefill phase nor decode phase. Each step has a token budget;
running sequences get their next tokens first (one for a decode, a chunk for a long
prefill), then waiting sequences are admitted, longest cached prefix skipped, while
budget, sequence slots and KV blocks last. When a running sequence cannot get a
block, a victim chosen by the preemption policy gives all of its blocks back and is
recomputed later (its full blocks stay in the prefix cache, so that is usually cheap).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from services.executor.kv.manager import KVCacheManager
from services.executor.policy.preemption import PreemptionPolicy
from services.executor.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the sequence and so picks a token."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass(frozen=True)
class StepPlan:
    decodes: list[ScheduledSeq]  # one new token each
    prefills: list[ScheduledSeq]  # a chunk each
    preempted: list[Sequence]
    # Sequences that cannot fit even in an otherwise empty pool: taken out of the
    # queues (blocks freed); the engine finishes them.
    unservable: list[Sequence] = ()

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills and not self.unservable

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(s.num_new_tokens for s in self.prefills)


class BatchScheduler:
    """Owns the waiting queue and the running set; decides each step's batch."""

    def __init__(
        self,
        kv: KVCacheManager,
        policy: PreemptionPolicy,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_prefill_chunk: int,
    ) -> None:
        self.kv = kv
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_chunk = max_prefill_chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out of the queues and give its blocks back (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, victim: Sequence) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(victim)

    def _useful_victims(self, seq: Sequence, n: int, scheduled_ids: set[str]) -> list[Sequence]:
        """Running sequences whose blocks ``seq`` could actually use: its own partition's
        when its quota is what blocks it, else its own or a borrower's (others'
        reserved blocks stay protected even when freed). ``seq`` itself as a last resort."""
        pool = self.kv.pool
        unscheduled = [s for s in self.running if s.request_id not in scheduled_ids]
        if not pool.usage_allows(self.kv.num_blocks_needed(seq, n), seq.partition):
            useful = [s for s in unscheduled if s.partition == seq.partition]
        else:
            useful = [s for s in unscheduled if s.partition == seq.partition or pool.borrowed_blocks(s.partition) > 0]
        return useful or [seq]

    def schedule(self) -> StepPlan:
        budget = self.max_num_batched_tokens
        decodes: list[ScheduledSeq] = []
        prefills: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        scheduled_ids: set[str] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget, self.max_prefill_chunk)
            while not self.kv.allocate_slots(seq, n):
                victim = self.policy.pick_victim(self._useful_victims(seq, n, scheduled_ids), self.kv.pool)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                (decodes if n == 1 else prefills).append(ScheduledSeq(seq, n))
                scheduled_ids.add(seq.request_id)
                budget -= n
                i += 1
                continue
            # ``seq`` itself was preempted: the list shifted, do not advance ``i``.

        unservable: list[Sequence] = []
        if not preempted:
            self.policy.order_waiting(self.waiting)
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                hits = self.kv.match_prefix(seq)
                cached = len(hits) * self.kv.block_size
                n = min(seq.num_tokens - cached, budget, self.max_prefill_chunk)
                if not self.kv.allocate_slots(seq, n, hits):
                    if not self.running and not decodes and not prefills:
                        # Nothing else holds blocks, yet it does not fit: it never will.
                        self.waiting.popleft()
                        self.kv.free(seq)
                        unservable.append(seq)
                        continue
                    break
                self.waiting.popleft()
                if seq.status is SequenceStatus.WAITING:
                    seq.num_cached_tokens = cached
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                (decodes if n == 1 else prefills).append(ScheduledSeq(seq, n))
                budget -= n
        return StepPlan(decodes, prefills, preempted, unservable)
