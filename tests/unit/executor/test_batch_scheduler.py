"""BatchScheduler over a real BlockPool + KVCacheManager, driven like the engine drives
it (schedule, advance, sample a token) but with no model."""
from __future__ import annotations

import pytest

from services.executor.engine.batch_scheduler import BatchScheduler
from services.executor.engine.step_plan import StepPlan
from services.executor.engine.step_plan import StepResult
from services.executor.kv.block_pool import BlockPool, PartitionSpec
from services.executor.kv.manager import KVCacheManager
from services.executor.policy.preemption import make_preemption_policy
from services.executor.engine.sampling_params import SamplingParams
from services.executor.engine.sequence import FinishReason, Sequence, SequenceStatus
from services.executor.model.sampler import SampledTokens

BLOCK = 4
NEXT_TOKEN = 7  # every "sampled" token; the model is not what is under test


def _scheduler(
    num_blocks: int = 64,
    *,
    policy: str = "fcfs",
    max_num_seqs: int = 8,
    budget: int = 64,
    chunk: int = 64,
    partitions: list[PartitionSpec] = (),
) -> BatchScheduler:
    pool = BlockPool(num_blocks, BLOCK, enable_prefix_caching=True, partitions=partitions)
    return BatchScheduler(
        KVCacheManager(pool), make_preemption_policy(policy), max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget, max_prefill_chunk=chunk,
    )


def _seq(rid: str, num_prompt: int, *, arrival: float, partition: str = "default", first_token: int = 100,
         priority: float = 0.0) -> Sequence:
    prompt = list(range(first_token, first_token + num_prompt))
    return Sequence(rid, prompt, SamplingParams(max_tokens=64), partition=partition, arrival_time=arrival,
                    priority=priority)


def _step(sched: BatchScheduler) -> StepPlan:
    """Schedule, then apply the plan with the scheduler's own ``update``, as LLMEngine
    does, for a model that samples NEXT_TOKEN wherever a step reaches a sequence's end."""
    plan = sched.schedule()
    sampled = [item for item in plan.decodes + plan.prefills if item.samples]
    sched.update(plan, StepResult(sampled, SampledTokens([NEXT_TOKEN] * len(sampled), None)))
    return plan


def _ids(seqs) -> list[str]:
    return [s.request_id for s in seqs]


def _chunks(plan: StepPlan) -> dict[str, int]:
    return {item.seq.request_id: item.num_new_tokens for item in plan.decodes + plan.prefills}


# -- chunked prefill and the token budget -----------------------------------------------
def test_long_prompt_is_prefilled_in_chunks_of_max_prefill_chunk():
    sched = _scheduler(chunk=16, budget=64)
    seq = _seq("a", 50, arrival=0)
    sched.add(seq)
    sizes = []
    while seq.num_output_tokens == 0:
        plan = _step(sched)
        sizes.append(_chunks(plan)["a"])
    assert sizes == [16, 16, 16, 2]
    assert seq.num_computed_tokens == 50


def test_a_step_never_schedules_more_tokens_than_the_budget():
    sched = _scheduler(budget=20, chunk=16)
    for i in range(4):
        sched.add(_seq(f"s{i}", 30, arrival=i, first_token=100 * (i + 1)))
    first = _step(sched)
    assert _chunks(first) == {"s0": 16, "s1": 4}
    for _ in range(20):
        plan = _step(sched)
        assert 0 < plan.num_tokens <= 20
        assert all(n <= 16 for n in _chunks(plan).values())


def test_running_decodes_are_scheduled_before_new_prefills():
    sched = _scheduler(budget=8, chunk=8)
    decoding = _seq("decoding", 3, arrival=0)
    sched.add(decoding)
    _step(sched)  # prefilled; now it decodes one token a step
    sched.add(_seq("new", 40, arrival=1, first_token=500))
    plan = _step(sched)
    assert [s.seq.request_id for s in plan.decodes] == ["decoding"]
    assert _chunks(plan) == {"decoding": 1, "new": 7}  # the prefill gets what is left


def test_a_new_prefill_is_not_admitted_when_decodes_use_the_whole_budget():
    sched = _scheduler(budget=2, chunk=2)
    for i in range(2):
        sched.add(_seq(f"d{i}", 2, arrival=i, first_token=100 * (i + 1)))
    _step(sched)
    sched.add(_seq("new", 10, arrival=5, first_token=900))
    plan = _step(sched)
    assert _chunks(plan) == {"d0": 1, "d1": 1}
    assert _ids(sched.waiting) == ["new"]


# -- prefix cache ---------------------------------------------------------------------
def test_prefix_hit_skips_cached_blocks():
    sched = _scheduler()
    first = _seq("first", 14, arrival=0)
    sched.add(first)
    _step(sched)
    sched.remove(first)  # finished; its three full blocks stay cached
    second = Sequence("second", first.prompt_token_ids[:12] + [1, 2, 3], SamplingParams(), arrival_time=1)
    sched.add(second)
    plan = _step(sched)
    assert second.num_cached_tokens == 12
    assert _chunks(plan) == {"second": 3}


def test_a_fully_cached_prompt_still_computes_its_last_token():
    sched = _scheduler()
    first = _seq("first", 3 * BLOCK, arrival=0)
    sched.add(first)
    _step(sched)
    sched.remove(first)
    again = Sequence("again", list(first.prompt_token_ids), SamplingParams(), arrival_time=1)
    sched.add(again)
    plan = _step(sched)
    # all three blocks are cached, but the step must produce logits: the last block is
    # recomputed (a hit is whole blocks), so at least one token runs.
    assert again.num_cached_tokens == 2 * BLOCK
    assert _chunks(plan) == {"again": BLOCK}
    assert again.num_output_tokens == 1


# -- preemption -----------------------------------------------------------------------
def test_running_out_of_blocks_preempts_the_newest_sequence_under_fcfs():
    # 6 blocks; three 2-block prompts fill the pool; each then needs a third block.
    sched = _scheduler(num_blocks=6, policy="fcfs")
    # Admitted (and so listed in ``running``) in a different order from arrival.
    mid = _seq("mid", 2 * BLOCK, arrival=1, first_token=200)
    newest = _seq("newest", 2 * BLOCK, arrival=2, first_token=300)
    oldest = _seq("oldest", 2 * BLOCK, arrival=0, first_token=100)
    for s in (mid, newest, oldest):
        sched.add(s)
    _step(sched)
    assert sched.kv.pool.num_free_blocks == 0
    plan = _step(sched)
    assert _ids(plan.preempted) == ["newest"]
    assert newest.status is SequenceStatus.PREEMPTED and newest.num_computed_tokens == 0
    assert newest.blocks == [] and newest.num_preemptions == 1
    assert _chunks(plan) == {"mid": 1, "oldest": 1}
    assert _ids(sched.waiting) == ["newest"]


def test_a_preempted_sequence_is_readmitted_and_recomputes_its_tokens():
    sched = _scheduler(num_blocks=6, policy="fcfs")
    keep = _seq("keep", 2 * BLOCK, arrival=0, first_token=100)
    victim = _seq("victim", 2 * BLOCK, arrival=1, first_token=200)
    third = _seq("third", 2 * BLOCK, arrival=0.5, first_token=300)
    for s in (keep, third, victim):
        sched.add(s)
    _step(sched)
    plan = _step(sched)
    assert _ids(plan.preempted) == ["victim"]
    tokens_before = list(victim.all_token_ids)  # prompt + the one token it sampled
    sched.remove(keep)  # finishes: room for the victim again
    sched.remove(third)
    plan = _step(sched)
    # its blocks were evicted while it waited: every token, the sampled one included,
    # is computed again, and the step then samples its next token
    assert _chunks(plan) == {"victim": len(tokens_before)}
    assert victim.status is SequenceStatus.RUNNING
    assert victim.all_token_ids == tokens_before + [NEXT_TOKEN]


def test_priority_policy_preempts_a_borrowing_partition_before_a_newer_one_within_its_reservation():
    # gold reserves 2 of 4 blocks; bronze reserves none and borrows.
    partitions = [PartitionSpec("gold", 2, 2), PartitionSpec("bronze", 0, 4)]
    sched = _scheduler(num_blocks=4, policy="priority", partitions=partitions)
    bronze = _seq("bronze", 2 * BLOCK, arrival=0, partition="bronze", first_token=100)
    gold = _seq("gold", 2 * BLOCK, arrival=1, partition="gold", first_token=200)
    sched.add(bronze)
    sched.add(gold)
    _step(sched)
    assert sched.kv.pool.borrowed_blocks("bronze") == 2 and sched.kv.pool.borrowed_blocks("gold") == 0
    plan = _step(sched)
    assert _ids(plan.preempted) == ["bronze"]  # FCFS would pick gold, the newer one
    assert _chunks(plan) == {"gold": 1}


def test_fcfs_does_not_preempt_a_sequence_whose_blocks_the_requester_could_not_use():
    # Same setting under the default policy: bronze needs a block, but gold is within
    # its reservation, so gold's blocks would stay protected from bronze. Preempting
    # gold frees nothing bronze may take; only bronze itself should give way.
    partitions = [PartitionSpec("gold", 2, 2), PartitionSpec("bronze", 0, 4)]
    sched = _scheduler(num_blocks=4, policy="fcfs", partitions=partitions)
    bronze = _seq("bronze", 2 * BLOCK, arrival=0, partition="bronze", first_token=100)
    gold = _seq("gold", 2 * BLOCK, arrival=1, partition="gold", first_token=200)
    sched.add(bronze)
    sched.add(gold)
    _step(sched)
    plan = _step(sched)
    assert _ids(plan.preempted) == ["bronze"]
    assert _chunks(plan) == {"gold": 1}


def test_a_prompt_that_cannot_fit_an_empty_pool_is_reported_unservable():
    sched = _scheduler(num_blocks=2, chunk=64)
    too_big = _seq("too_big", 3 * BLOCK, arrival=0)
    sched.add(too_big)
    plan = sched.schedule()
    assert _ids(plan.unservable) == ["too_big"]
    assert not sched.has_work
    assert sched.kv.pool.num_free_blocks == 2


# -- admission limits -------------------------------------------------------------------
def test_no_more_than_max_num_seqs_run_at_once():
    sched = _scheduler(max_num_seqs=2)
    seqs = [_seq(f"s{i}", 5, arrival=i, first_token=100 * (i + 1)) for i in range(5)]
    for s in seqs:
        sched.add(s)
    admitted_order = []
    for _ in range(6):
        plan = _step(sched)
        assert len(sched.running) <= 2
        assert len(plan.decodes) + len(plan.prefills) <= 2
        for s in list(sched.running):
            if s.request_id not in admitted_order:
                admitted_order.append(s.request_id)
            if s.num_output_tokens >= 2:
                sched.remove(s)
    assert admitted_order == ["s0", "s1", "s2", "s3", "s4"]


def test_a_shared_prefix_hit_counts_against_the_partitions_quota():
    # b may hold 1 block; a 2-block prefix cached by a must not let b exceed that.
    partitions = [PartitionSpec("a", 0, 4), PartitionSpec("b", 0, 1)]
    sched = _scheduler(num_blocks=8, partitions=partitions)
    owner = _seq("owner", 2 * BLOCK + 1, arrival=0, partition="a")
    sched.add(owner)
    _step(sched)  # owner holds its 3 blocks, two of them cached
    sharer = Sequence("sharer", list(owner.prompt_token_ids), SamplingParams(), partition="b", arrival_time=1)
    sched.add(sharer)
    _step(sched)
    assert sched.kv.pool.used_blocks("b") <= 1
    assert sharer.status is SequenceStatus.WAITING


# -- a step's result: update, requeue, finish -----------------------------------------------
def test_update_finishes_a_sequence_at_max_tokens_and_gives_its_blocks_back():
    sched = _scheduler(num_blocks=8)
    seen: list[tuple[str, int]] = []
    sched.on_finish = lambda seq: seen.append((seq.request_id, len(seq.blocks)))  # sees it before the free
    seq = Sequence("short", list(range(100, 100 + BLOCK)), SamplingParams(max_tokens=2), arrival_time=0)
    sched.add(seq)
    _step(sched)
    assert seq.output_token_ids == [NEXT_TOKEN] and not seq.is_finished
    _step(sched)
    assert seq.is_finished and seq.finish_reason.value == "length"
    assert seen == [("short", 2)] and seq.blocks == []
    assert not sched.has_work and sched.kv.pool.num_free_blocks == 8


def test_update_stops_on_an_eos_token_once_min_tokens_are_out():
    pool = BlockPool(8, BLOCK, enable_prefix_caching=True)
    sched = BatchScheduler(KVCacheManager(pool), make_preemption_policy("fcfs"), max_num_seqs=4,
                           max_num_batched_tokens=64, max_prefill_chunk=64, eos_token_ids=[NEXT_TOKEN])
    eager = Sequence("eager", [1, 2, 3], SamplingParams(max_tokens=8), arrival_time=0)
    patient = Sequence("patient", [4, 5, 6], SamplingParams(max_tokens=8, min_tokens=2), arrival_time=1)
    sched.add(eager)
    sched.add(patient)
    _step(sched)
    assert eager.finish_reason.value == "stop" and eager.num_output_tokens == 1
    assert not patient.is_finished
    _step(sched)
    assert patient.finish_reason.value == "stop" and patient.num_output_tokens == 2


def test_requeue_puts_a_taken_out_sequence_first_in_the_state_it_had():
    sched = _scheduler()
    first, again = _seq("first", 4, arrival=0), _seq("again", 4, arrival=1)
    sched.add(first)
    again.num_preemptions = 1  # it ran before
    sched.requeue(again)
    assert _ids(sched.waiting) == ["again", "first"]
    assert again.status is SequenceStatus.PREEMPTED and first.status is SequenceStatus.WAITING


def test_finish_takes_a_running_sequence_out_and_frees_its_blocks_without_on_finish():
    sched = _scheduler(num_blocks=8)
    sched.on_finish = lambda seq: pytest.fail("finish() keeps nothing of the sequence")
    seq = _seq("gone", 2 * BLOCK, arrival=0)
    sched.add(seq)
    _step(sched)
    assert sched.kv.pool.num_free_blocks < 8
    sched.finish(seq, FinishReason.ABORT)
    assert seq.status is SequenceStatus.FINISHED and seq.finish_reason is FinishReason.ABORT
    assert not sched.has_work and sched.kv.pool.num_free_blocks == 8


def test_kv_manager_counts_blocks_for_tokens():
    kv = KVCacheManager(BlockPool(8, BLOCK, enable_prefix_caching=True))
    assert [kv.num_blocks_for(n) for n in (0, 1, BLOCK, BLOCK + 1)] == [0, 1, 1, 2]
    assert kv.num_blocks_to_run(BLOCK) == 2  # plus one for what it will generate
