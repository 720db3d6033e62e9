"""A step's plan and its result: what the batch scheduler hands the model runner, and what
comes back for the scheduler to apply (``BatchScheduler.update``).

Both are frozen records over live ``Sequence`` objects; neither does anything.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.executor.engine.sequence import Sequence
from services.executor.model.sampler import SampledTokens


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


@dataclass(frozen=True)
class StepResult:
    sampled: list[ScheduledSeq]  # rows that picked a token, in order
    tokens: SampledTokens
    # [len(plan.decodes) + len(plan.prefills), max_blocks] float32 attention mass per
    # block-table entry (decodes first, then prefills), or None when not tracked
    block_scores: torch.Tensor | None = None
