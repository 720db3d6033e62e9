"""A step's plan: which scheduled rows sample a token, and how many tokens it computes."""
from __future__ import annotations

from services.executor.engine.sampling_params import SamplingParams
from services.executor.engine.sequence import Sequence
from services.executor.engine.step_plan import ScheduledSeq, StepPlan


def _seq(num_prompt: int, num_computed: int) -> Sequence:
    seq = Sequence("r", list(range(1, num_prompt + 1)), SamplingParams())
    seq.num_computed_tokens = num_computed
    return seq


def test_a_row_samples_only_when_its_chunk_reaches_the_end_of_the_sequence():
    assert ScheduledSeq(_seq(10, 0), 10).samples
    assert not ScheduledSeq(_seq(10, 0), 8).samples  # a prefill chunk short of the end
    assert ScheduledSeq(_seq(10, 9), 1).samples  # a decode


def test_a_plan_counts_its_tokens_and_is_empty_only_with_nothing_to_do():
    decode, chunk = ScheduledSeq(_seq(10, 9), 1), ScheduledSeq(_seq(40, 0), 16)
    assert StepPlan([decode], [chunk], []).num_tokens == 17
    assert StepPlan([], [], []).is_empty
    assert not StepPlan([], [], [], unservable=[_seq(4, 0)]).is_empty
