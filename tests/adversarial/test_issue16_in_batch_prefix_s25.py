"""Issue 16, the in-batch prefix check (BatchScheduler.schedule, KVCacheManager
completing_hashes / next_hit_hash) attacked: a copy deferred for one step keeps its seat
(a later arrival must not take it and make the copy wait a whole generation); a leader
aborted or preempted mid-prefill does not hold its copies back; copies of one prompt from
two tenants (different salts) neither wait on each other nor share blocks; a copy owed
prompt logprobs is never deferred and gets the logprobs a lone run gets; 64 copies, copies
one step apart, a pool too small for all, max_num_seqs 1: greedy tokens are those the
scheduler gives with the check off, and every request finishes."""
from __future__ import annotations

import pytest

from services.executor.engine.config import EngineConfig
from services.executor.engine.engine import LLMEngine
from services.executor.engine.sampling_params import SamplingParams
from services.executor.engine.sequence import FinishReason
from tests.unit.executor.test_batch_scheduler import _chunks, _ids, _scheduler, _seq, _step
from weft.testing.tiny_model import make_tiny_checkpoint


def test_a_deferred_copy_keeps_its_seat_from_a_later_arrival():
    sched = _scheduler(max_num_seqs=2)  # blocks of 4 tokens
    sched.add(_seq("a", 12, arrival=0.0))
    sched.add(_seq("b", 12, arrival=1.0))  # a's prompt: deferred one step
    sched.add(_seq("c", 12, arrival=2.0, first_token=500))  # arrived after b
    assert _chunks(_step(sched)) == {"a": 12}
    # b hits a's blocks now; on the old scheduler c had taken b's seat in the first step and
    # b waited for a or c to finish (64 tokens here, a whole generation in general)
    assert _chunks(_step(sched)) == {"a": 1, "b": 4}
    assert _ids(sched.waiting) == ["c"]


def test_a_copy_is_not_held_back_by_a_leader_aborted_mid_prefill():
    sched = _scheduler(chunk=4)  # the leader's 16 tokens take 4 steps
    a, b = _seq("a", 16, arrival=0.0), _seq("b", 16, arrival=1.0)
    sched.add(a)
    sched.add(b)
    assert _chunks(_step(sched)) == {"a": 4}
    sched.finish(a, FinishReason.ABORT)  # aborted between steps: nothing fills b's next block now
    plan = _step(sched)
    assert _chunks(plan) == {"b": 4} and b.num_cached_tokens == 4  # a's finished block still hits


def test_copies_finish_in_a_pool_that_preempts_them():
    sched = _scheduler(num_blocks=26, chunk=4, budget=8)  # one sequence of 80 tokens: 20 blocks
    seqs = [_seq(rid, 16, arrival=float(i)) for i, rid in enumerate("abc")]
    for s in seqs:
        sched.add(s)
    preempted = 0
    for _ in range(1000):
        if not sched.has_work:
            break
        plan = _step(sched)
        preempted += len(plan.preempted)
        assert not plan.unservable
    assert preempted and not sched.has_work
    assert [s.num_output_tokens for s in seqs] == [64, 64, 64]


def test_copies_from_two_tenants_neither_wait_nor_share(tmp_path):
    engine = LLMEngine(make_tiny_checkpoint(tmp_path / "m", "tiny", "llama"), EngineConfig(num_kv_blocks=64))
    prompt = [(10 + 7 * i) % 1024 for i in range(40)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("t1", prompt, params, tenant_salt="tenant-1")
    engine.add_request("t2", prompt, params, tenant_salt="tenant-2")
    plan = engine.scheduler.schedule()
    assert _chunks(plan) == {"t1": 40, "t2": 40}  # salted hashes differ: nothing to wait for
    blocks = [{b.block_id for b in item.seq.blocks} for item in plan.prefills]
    assert not blocks[0] & blocks[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "tiny", "llama", seed=5)


def _run(path, check: bool, arrivals: list[tuple[int, str, list[int], SamplingParams]], **config):
    """Greedy outputs and finish reasons; arrivals: (step, request id, prompt, params)."""
    engine = LLMEngine(path, EngineConfig(**{"num_kv_blocks": 128, **config}))
    engine.scheduler.in_batch_prefix_check = check
    out: dict[str, list] = {}
    for step in range(2000):
        for at, rid, prompt, params in arrivals:
            if at == step:
                engine.add_request(rid, prompt, params)
        if step > max(a[0] for a in arrivals) and not engine.has_unfinished_requests:
            break
        for o in engine.step():
            tokens, lps, _ = out.setdefault(o.request_id, ([], list(o.prompt_logprobs), None))
            tokens.extend(o.new_token_ids)
            if o.finished:
                out[o.request_id] = (tokens, lps, o.finish_reason)
    assert not engine.has_unfinished_requests
    return out


PROMPT = [(11 + 13 * i) % 1000 for i in range(70)]
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
SCENARIOS = {
    "64_copies": ([(0, f"n{i}", PROMPT, GREEDY) for i in range(64)], {"max_num_seqs": 64, "num_kv_blocks": 600}),
    "one_step_apart": ([(i, f"n{i}", PROMPT[:40 + i], GREEDY) for i in range(6)], {"max_prefill_chunk": 16}),
    "pool_too_small": ([(0, f"n{i}", PROMPT, GREEDY) for i in range(4)], {"num_kv_blocks": 9}),
    "max_num_seqs_1": ([(0, f"n{i}", PROMPT, GREEDY) for i in range(3)], {"max_num_seqs": 1}),
    "seats_2": ([(0, "a", PROMPT, GREEDY), (0, "b", PROMPT, GREEDY), (0, "c", PROMPT[::-1], GREEDY)],
                {"max_num_seqs": 2}),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_greedy_tokens_are_the_same_with_the_check_on_and_off(checkpoint, name):
    arrivals, config = SCENARIOS[name]
    on, off = _run(checkpoint, True, arrivals, **config), _run(checkpoint, False, arrivals, **config)
    assert set(on) == {a[1] for a in arrivals}
    assert on == off


def test_a_copy_owed_prompt_logprobs_gets_those_of_a_lone_run(checkpoint):
    asks = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    alone = _run(checkpoint, True, [(0, "p", PROMPT, asks)])
    both = _run(checkpoint, True, [(0, "a", PROMPT, GREEDY), (0, "p", PROMPT, asks)])
    assert len(both["p"][1]) == len(PROMPT) - 1
    assert both["p"][0] == alone["p"][0]
    assert both["p"][1] == pytest.approx(alone["p"][1], abs=1e-4)
