"""Iteration-level batch scheduling inside one executor.

NOTE: there is no prefill phase nor decode phase. Each step has a token budget;
running sequences get their next tokens first (one for a decode, a chunk for a long
prefill), then waiting sequences are admitted, longest cached prefix skipped, while
budget, sequence slots and KV blocks last. A waiting sequence whose next uncached block is
being computed in this very step by another sequence (forked sub-agents, programs
starting on one system prompt, one prompt sent by several callers) waits one step and hits
it, instead of computing the same prefix again beside it (SGLang's in-batch prefix
check; vLLM computes both). When a running sequence cannot get a
block, idle sessions' pins (the *keep* of a tool pause, services/executor/kv/pinning.py)
yield first, the session expected back last first; only then does a victim chosen by the
preemption policy give all of its blocks back to be recomputed later (its full blocks stay
in the prefix cache, so that is usually cheap). A waiting sequence that does not fit gets
the same: live work comes before kept KV, which only protects a paused session's blocks
from LRU eviction while the pool has other room.

The scheduler also owns what a step's result does to its sequences (``update``: advance,
append, stop, finish; nano-vllm's ``postprocess``, vLLM's ``update_from_output``), so
nobody else edits its queues: the engine asks it to ``requeue`` or ``finish`` a sequence.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from services.executor.engine.sequence import FinishReason, Sequence, SequenceStatus
from services.executor.engine.step_plan import ScheduledSeq, StepPlan, StepResult
from services.executor.kv.manager import KVCacheManager
from services.executor.policy.preemption import PreemptionPolicy


class BatchScheduler:
    """Owns the waiting queue and the running set; decides each step's batch."""

    def __init__(
        self,
        kv: KVCacheManager,
        policy: PreemptionPolicy,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_prefill_chunk: int,
        eos_token_ids: Iterable[int] = (),
        on_finish: Callable[[Sequence], None] | None = None,
        kv_compression: bool = False,
    ) -> None:
        """``on_finish`` sees each sequence that stops in ``update`` while it still holds
        its blocks (the engine pins a session's blocks there). ``kv_compression``: the
        engine drops blocks of long sequences, so a sequence longer than the pool may
        still run (it is then never judged unservable by its length)."""
        self.kv = kv
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_chunk = max_prefill_chunk
        self.eos_token_ids = frozenset(eos_token_ids)
        self.on_finish = on_finish
        self.kv_compression = kv_compression
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.in_batch_prefix_check = True  # False: copies compute side by side (the benchmark's baseline)
        # (partition or None for anyone's, blocks wanted, session to spare) -> blocks unpinned;
        # set by the engine that owns the pins (None: nothing is ever pinned)
        self.reclaim_pins: Callable[..., int] | None = None
        self.num_pin_yields = 0  # allocations that succeeded only after pins were released

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def requeue(self, seq: Sequence) -> None:
        """Put a sequence the scheduler took out of the queues (an unservable one whose
        room was freed since) back at the head of the waiting queue, in the state it had:
        waiting, or preempted when it ran before."""
        seq.status = SequenceStatus.WAITING if not seq.num_preemptions else SequenceStatus.PREEMPTED
        self.waiting.appendleft(seq)

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out of the queues and give its blocks back (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End ``seq`` now (abort, or unservable: a length stop): out of the queues, its
        blocks given back. ``on_finish`` is not called: nothing of it is kept."""
        self.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

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

    def _allocate(self, seq: Sequence, n: int, hits: list = ()) -> bool:
        """``kv.allocate_slots``, releasing idle sessions' pins while that makes it fit."""
        if self.kv.allocate_slots(seq, n, hits):
            return True
        if self.reclaim_pins is None:
            return False
        # a quota cut is only helped by the partition's own pins; a full pool by anyone's
        partition = None if self.kv.partition_allows(seq, n) else seq.partition
        need = max(1, self.kv.num_blocks_needed(seq, n, len(hits)))
        while self.reclaim_pins(partition, need, seq.session.session_id, seq.partition):
            if self.kv.allocate_slots(seq, n, hits):
                self.num_pin_yields += 1
                return True
        return False

    def _useful_victims(self, seq: Sequence, n: int, scheduled_ids: set[str]) -> list[Sequence]:
        """Running sequences whose blocks ``seq`` could actually use: its own partition's
        when its quota is what blocks it, else its own or a borrower's (others'
        reserved blocks stay protected even when freed). ``seq`` itself as a last resort."""
        unscheduled = [s for s in self.running if s.request_id not in scheduled_ids]
        if not self.kv.partition_allows(seq, n):
            useful = [s for s in unscheduled if s.partition == seq.partition]
        else:
            useful = [s for s in unscheduled if s.partition == seq.partition or self.kv.is_borrowing(s.partition)]
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
            while not self._allocate(seq, n):
                victim = self.policy.pick_victim(self._useful_victims(seq, n, scheduled_ids), self.kv)
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
        deferred: list[Sequence] = []
        if not preempted:
            pending = {h for item in decodes + prefills for h in self.kv.completing_hashes(item.seq, item.num_new_tokens)}
            self.policy.order_waiting(self.waiting)
            # a deferred copy keeps its seat: a later arrival taking it would make the copy
            # wait for a whole generation instead of one step
            while self.waiting and budget > 0 and len(self.running) + len(deferred) < self.max_num_seqs:
                seq = self.waiting[0]
                if seq.num_preemptions and not self.kv_compression and not self.kv.can_ever_hold(seq):
                    # It outgrew its partition (or the pool) and preempted itself; its first
                    # chunk would still fit, so without this it would be recomputed up to the
                    # cap and preempted again, for ever (with prefix hits, allocation fails
                    # below instead).
                    self.waiting.popleft()
                    self.kv.free(seq)
                    unservable.append(seq)
                    continue
                hits = self.kv.match_prefix(seq)
                if pending and self.in_batch_prefix_check and self.kv.next_hit_hash(seq, len(hits)) in pending:
                    deferred.append(self.waiting.popleft())  # a hit next step: see the module NOTE
                    continue
                cached = len(hits) * self.kv.block_size
                n = min(seq.num_tokens - cached, budget, self.max_prefill_chunk)
                if not self._allocate(seq, n, hits):
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
                pending.update(self.kv.completing_hashes(seq, n))
                budget -= n
            self.waiting.extendleft(reversed(deferred))  # back in front, in their order
        return StepPlan(decodes, prefills, preempted, unservable)

    # -- a step's result --------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult) -> list[Sequence]:
        """Apply an executed ``plan``: every scheduled sequence advances by its chunk and
        registers the blocks that became full; each sampled row appends its token (and
        logprob / entropy when asked) and is checked for a stop. A sequence that stops is
        shown to ``on_finish`` while it holds its blocks, then leaves the running set and
        gives them back. Returns the sequences that got a token, in row order."""
        for item in plan.decodes + plan.prefills:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.kv.cache_computed_blocks(item.seq)
        tokens = result.tokens
        sampled: list[Sequence] = []
        for row, item in enumerate(result.sampled):
            seq = item.seq
            logprob = tokens.logprobs[row] if tokens.logprobs is not None and seq.params.logprobs else None
            top = tokens.top_logprobs[row] if tokens.top_logprobs is not None and seq.params.top_logprobs else None
            seq.append_token(tokens.token_ids[row], logprob, top)
            if tokens.entropies is not None:
                seq.entropy_sum += tokens.entropies[row]
            self._check_stop(seq)
            if seq.is_finished:
                if self.on_finish is not None:
                    self.on_finish(seq)
                self.remove(seq)
            sampled.append(seq)
        return sampled

    def _check_stop(self, seq: Sequence) -> None:
        """STOP on an EOS / stop token once ``min_tokens`` are out; LENGTH at
        ``max_tokens`` or the model's context; KV_QUOTA at the cap of the task contract's
        KV quota (before ``max_tokens``: the caller asked for more than its quota holds).

        A grammar that has ended (it accepted a stop token) or failed (no token it allows
        is left) stops the request whatever ``min_tokens`` and ``ignore_eos`` say: no token
        could be added that the grammar allows. At ``max_tokens`` first, the output is a
        truncated prefix of a valid one (LENGTH), as with OpenAI."""
        p = seq.params
        tok = seq.output_token_ids[-1]
        reason = None
        if seq.grammar is not None and seq.grammar.finished:
            reason = FinishReason.STOP
        elif seq.num_output_tokens >= p.min_tokens and (
            (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids
        ):
            reason = FinishReason.STOP
        elif seq.num_output_tokens >= p.max_tokens:
            reason = FinishReason.LENGTH
        elif seq.num_tokens >= seq.max_num_tokens:
            reason = FinishReason.KV_QUOTA if seq.capped_by_kv_quota else FinishReason.LENGTH
        if reason is not None:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = reason
