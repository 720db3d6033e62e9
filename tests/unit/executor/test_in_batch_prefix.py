"""A waiting sequence whose next uncached block another sequence computes in the same step
waits one step and hits it (the n completions of one prompt, forked sub-agents, programs
starting on one system prompt): the prefix is computed once, not once per copy."""
from __future__ import annotations

import pytest

from services.executor.engine.config import EngineConfig
from services.executor.engine.engine import LLMEngine
from services.executor.engine.sampling_params import SamplingParams
from services.executor.kv.block_pool import BlockPool
from services.executor.kv.manager import KVCacheManager
from services.executor.engine.batch_scheduler import BatchScheduler
from services.executor.policy.preemption import make_preemption_policy
from tests.unit.executor.test_batch_scheduler import _chunks, _ids, _scheduler, _seq, _step
from weft.testing.tiny_model import make_tiny_checkpoint


def test_a_copy_of_a_prompt_in_prefill_waits_one_step_and_hits_its_blocks():
    sched = _scheduler()  # blocks of 4 tokens
    a, b = _seq("a", 12, arrival=0.0), _seq("b", 12, arrival=1.0)  # the same 12 tokens
    other = _seq("other", 12, arrival=2.0, first_token=500)
    for s in (a, b, other):
        sched.add(s)
    first = _step(sched)
    assert _chunks(first) == {"a": 12, "other": 12}  # b would compute a's blocks beside it
    assert _ids(sched.waiting) == ["b"]  # the one behind it was not held up
    second = _step(sched)
    # a hit may cover (12 - 1) // 4 = 2 blocks: b computes its last 4 tokens only
    assert _chunks(second) == {"a": 1, "other": 1, "b": 4}
    assert b.num_cached_tokens == 8


def test_a_copy_waits_for_the_blocks_a_running_chunked_prefill_fills_this_step():
    sched = _scheduler(chunk=8)  # a's 16 tokens take two steps of 8
    a = _seq("a", 16, arrival=0.0)
    sched.add(a)
    assert _chunks(_step(sched)) == {"a": 8}
    sched.add(_seq("b", 16, arrival=1.0))
    assert _chunks(_step(sched)) == {"a": 8}  # a fills blocks 2-3 now: b hits them next step
    third = _step(sched)
    assert _chunks(third) == {"a": 1, "b": 4}  # (16 - 1) // 4 = 3 blocks hit
    assert sched.running[-1].num_cached_tokens == 12


def test_deferred_copies_keep_their_order_at_the_front():
    sched = _scheduler()
    for i, rid in enumerate(("a", "b", "c")):
        sched.add(_seq(rid, 12, arrival=float(i)))
    sched.add(_seq("z", 8, arrival=3.0, first_token=700))
    assert _chunks(_step(sched)) == {"a": 12, "z": 8}
    assert _ids(sched.waiting) == ["b", "c"]
    assert _chunks(_step(sched)) == {"a": 1, "z": 1, "b": 4, "c": 4}


def test_without_prefix_caching_every_copy_computes_at_once():
    pool = BlockPool(64, 4, enable_prefix_caching=False)
    sched = BatchScheduler(KVCacheManager(pool), make_preemption_policy("fcfs"), max_num_seqs=8,
                           max_num_batched_tokens=64, max_prefill_chunk=64)
    sched.add(_seq("a", 12, arrival=0.0))
    sched.add(_seq("b", 12, arrival=1.0))
    assert _chunks(_step(sched)) == {"a": 12, "b": 12}  # nothing to wait for: no hit would come


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), preset="tiny", arch="llama")


def _outputs(engine: LLMEngine, prompts: dict[str, list[int]]) -> tuple[dict[str, list[int]], dict[str, int]]:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    for _ in range(200):
        if not engine.has_unfinished_requests:
            break
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            cached[out.request_id] = out.num_cached_tokens
    assert not engine.has_unfinished_requests
    return tokens, cached


def test_n_copies_of_a_prompt_compute_its_prefix_once_and_decode_the_same_tokens(checkpoint):
    prompt = [(10 + 7 * i) % 1024 for i in range(40)]  # 2 full blocks of 16 a hit may cover
    alone, _ = _outputs(LLMEngine(checkpoint, EngineConfig(num_kv_blocks=64)), {"alone": prompt})
    tokens, cached = _outputs(LLMEngine(checkpoint, EngineConfig(num_kv_blocks=64)),
                              {f"n{i}": list(prompt) for i in range(4)})
    assert all(t == alone["alone"] for t in tokens.values()), tokens
    assert sorted(cached.values()) == [0, 32, 32, 32]  # one computed the prefix, three hit it
