"""Issue 17 under attack (A1): pins that yield to live work, released sessions, and the
measured rates a load report carries.

The engine part is a property test: random sequences of requests (shared prefixes, pinned
sessions with TTLs from tiny to effectively forever, two hops of one session at once, a
pinned session's own next hop), aborts, session ends, clock jumps and steps, under prefix
caching on and off, KV compression and tenant partitions. After every operation the pool's
bookkeeping must be exact (a block's references are its holders', the free queues hold
exactly the unreferenced blocks, each partition's use is the blocks it holds, a pin holds
only referenced blocks); when the work is done and the pins are gone every block is free
again (no leak), and no free ever raises (no double free).
"""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.executor.engine.config import EngineConfig
from services.executor.engine.engine import LLMEngine
from services.executor.engine.sampling_params import SamplingParams
from services.executor.engine.sequence import SessionOptions
from services.executor.errors import InvalidRequestError
from services.executor.kv.block_pool import PartitionSpec
from services.scheduler.api.convert import executor_load
from services.scheduler.policy.pause import CostPausePolicy, PauseInputs
from weft.testing.tiny_model import make_tiny_checkpoint
from weft.v1 import events_pb2

BS = 4
NUM_BLOCKS = 24
PREFIXES = [[(p * 131 + 7 * i) % 1000 for i in range(12)] for p in range(3)]  # 3 blocks each
SESSIONS = ["s0", "s1", "s2", "s3"]
TTLS_S = [0.0, 0.001, 2.0, 1e9]  # no pin, gone at the next tick, a tool pause, forever

CONFIGS = {
    "prefix caching": dict(),
    "no prefix caching": dict(enable_prefix_caching=False),
    "kv compression": dict(kv_compress_budget_blocks=6, kv_compress_recent_blocks=2),
    "partitions": dict(),
}
PARTITIONS = [PartitionSpec("A", reserved_blocks=8, credit_blocks=4), PartitionSpec("B", credit_blocks=NUM_BLOCKS)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), preset="tiny")


def _check_pool(engine: LLMEngine) -> None:
    pool = engine.pool
    free_ids = set(pool._free_uncached) | set(pool._free_cached)
    assert len(free_ids) == len(pool._free_uncached) + len(pool._free_cached)  # on one queue only
    used: dict[str, int] = {}
    for block in pool.blocks:
        assert block.ref_cnt == sum(block.holders.values()) >= 0, block
        assert (block.ref_cnt == 0) == (block.block_id in free_ids), block
        if block.block_id in pool._free_cached:
            assert block.block_hash is not None and pool._cached[block.block_hash] is block
        for partition in block.holders:
            used[partition] = used.get(partition, 0) + 1
    assert {p: n for p, n in pool._used.items() if n} == used
    for sid in SESSIONS:
        assert all(b.ref_cnt > 0 for b in engine.pins.pinned_blocks(sid))


add_op = st.tuples(st.just("add"), st.sampled_from([None, *SESSIONS]), st.sampled_from(TTLS_S),
                   st.integers(0, len(PREFIXES) - 1), st.integers(1, 30), st.integers(1, 40),
                   st.sampled_from(["A", "B"]))
ops = st.lists(st.one_of(
    add_op,
    st.tuples(st.just("step"), st.integers(1, 6)),
    st.tuples(st.just("abort"), st.integers(0, 40)),
    st.tuples(st.just("end"), st.sampled_from(SESSIONS)),
    st.tuples(st.just("tick"), st.sampled_from([0.01, 5.0])),
), min_size=1, max_size=30)


@pytest.mark.parametrize("config", sorted(CONFIGS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(program=ops)
def test_random_pins_yields_aborts_and_ends_never_leak_or_double_free_a_block(checkpoint, config, program):
    engine = LLMEngine(checkpoint, EngineConfig(num_kv_blocks=NUM_BLOCKS, block_size=BS, **CONFIGS[config]))
    if config == "partitions":
        engine.set_partitions(PARTITIONS)
    now = [0.0]
    engine.pins.clock = lambda: now[0]
    added: list[str] = []
    for op in program:
        kind = op[0]
        if kind == "add":
            _, sid, ttl_s, prefix, num_new, max_tokens, partition = op
            rid = f"r{len(added)}"
            prompt = PREFIXES[prefix] + [(len(added) * 17 + i) % 1000 for i in range(num_new)]
            try:
                engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                                   partition=partition if config == "partitions" else "default",
                                   session=SessionOptions(sid or "", pin_ttl_s=ttl_s if sid else 0.0))
            except InvalidRequestError:
                pass  # too big for its partition: refused up front, nothing held
            added.append(rid)
        elif kind == "step":
            for _ in range(op[1]):
                if engine.has_unfinished_requests:
                    engine.step()
        elif kind == "abort" and added:
            engine.abort_request(added[op[1] % len(added)])
        elif kind == "end":
            engine.release_session(op[1])
        elif kind == "tick":
            now[0] += op[1]
            engine.pins.expire()
        _check_pool(engine)
    for _ in range(2000):
        if not engine.has_unfinished_requests:
            break
        engine.step()
        _check_pool(engine)
    assert not engine.has_unfinished_requests
    for sid in SESSIONS:
        engine.release_session(sid)
    _check_pool(engine)
    assert engine.pins.num_pinned_blocks == 0
    assert engine.pool.num_free_blocks == NUM_BLOCKS  # every block back: nothing leaked
    assert not any(engine.pool._used.values())


def test_a_hop_past_its_quota_is_cut_once_and_keeps_its_own_sessions_pin(checkpoint):
    """A hop that grows past its partition's quota, with its own session's pin the only
    one in its partition, ends as a length stop: the pin-yield loop terminates."""
    engine = LLMEngine(checkpoint, EngineConfig(num_kv_blocks=NUM_BLOCKS, block_size=BS))
    engine.set_partitions([PartitionSpec("A", credit_blocks=8), PartitionSpec("B", credit_blocks=NUM_BLOCKS)])
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.add_request("b", PREFIXES[1] + [5] * 8, greedy, partition="B", session=SessionOptions("sb", pin_ttl_s=60.0))
    engine.add_request("a", PREFIXES[0] + [9] * 8, greedy, partition="A", session=SessionOptions("sa", pin_ttl_s=60.0))
    while engine.has_unfinished_requests:
        engine.step()
    assert "sa" in engine.pins and "sb" in engine.pins  # A holds 5 of its 8 blocks pinned
    # A's next hop grows past its quota (9 blocks): only "sa" could make room, and it is spared
    engine.add_request("a-1", PREFIXES[0] + [9] * 8 + [3] * 4, SamplingParams(max_tokens=12, temperature=0.0,
                       ignore_eos=True), partition="A", session=SessionOptions("sa"))
    for _ in range(200):
        if not engine.has_unfinished_requests:
            break
        engine.step()
    assert not engine.has_unfinished_requests  # cut at its quota, not spinning
    _check_pool(engine)


# -- load reports ------------------------------------------------------------------------
@pytest.mark.parametrize("report", [
    dict(),  # nothing measured (an executor just restarted: counts back to 0)
    dict(prefill_tokens_per_s=5000.0, num_prefills=0, transfer_bytes_per_s=1e9, num_transfers=0, block_bytes=4096),
    dict(prefill_tokens_per_s=float("nan"), num_prefills=3),
    dict(prefill_tokens_per_s=-10.0, num_prefills=3, transfer_bytes_per_s=-1.0, num_transfers=2, block_bytes=4096),
    dict(transfer_bytes_per_s=1e9, num_transfers=2, block_bytes=0),
    dict(prefill_tokens_per_s=0.0, num_prefills=2**64 - 1, transfer_bytes_per_s=0.0, num_transfers=2**64 - 1),
], ids=["restarted", "counts-zero", "nan-prefill", "negative-rates", "block-bytes-zero", "huge-counts-zero-rates"])
def test_a_rate_that_is_unmeasured_nan_negative_or_zero_leaves_the_configured_costs(report):
    """Rates a restarted or confused executor reports count as not measured: the pause is
    priced exactly as with no report at all."""
    rates = executor_load(events_pb2.LoadReport(num_blocks=100, num_free_blocks=40, **report)).rates
    assert rates.prefill_ms_per_token is None and rates.transfer_ms_per_block is None

    def decide(prefill, transfer, overhead):
        return CostPausePolicy().decide(PauseInputs(
            num_context_tokens=160, num_blocks=10, expected_pause_ms=800.0, pool_used_blocks=60,
            pool_num_blocks=100, pool_pinned_blocks=0, can_demote=True, prefill_ms_per_token=prefill,
            transfer_ms_per_block=transfer, transfer_overhead_ms=overhead))

    plan = decide(rates.prefill_ms_per_token, rates.transfer_ms_per_block, rates.transfer_overhead_ms)
    assert plan == decide(None, None, 0.0)
    assert plan.cost_source == "configured" and all(math.isfinite(c) and c >= 0 for _, c in plan.costs_ms)
