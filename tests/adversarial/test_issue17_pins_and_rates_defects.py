"""Regression tests for attacker A1's defects (issue 17): broken rates in a load report,
pins released for partitions that cannot use them, an ended session orphaning another
session's cached context, and EndSession of unknown ids. Each failed on main at 5ebb567."""
from __future__ import annotations

import math

import pytest

from services.executor.engine.config import EngineConfig
from services.executor.engine.engine import LLMEngine
from services.executor.engine.sampling_params import SamplingParams
from services.executor.engine.sequence import SessionOptions
from services.executor.kv.block_pool import PartitionSpec
from services.scheduler.api.convert import executor_load
from services.scheduler.policy.pause import CostPausePolicy, PauseInputs
from weft.testing.tiny_model import make_tiny_checkpoint
from weft.v1 import events_pb2

BS = 4
INF, NAN = float("inf"), float("nan")


# -- load reports: measured rates a buggy or hostile executor publishes ------------------
def _decide(report: events_pb2.LoadReport, pool_used_blocks: int = 50):
    rates = executor_load(report).rates
    return CostPausePolicy().decide(PauseInputs(
        num_context_tokens=160, num_blocks=10, expected_pause_ms=500.0,
        pool_used_blocks=pool_used_blocks, pool_num_blocks=100, pool_pinned_blocks=0, can_demote=True,
        prefill_ms_per_token=rates.prefill_ms_per_token, transfer_ms_per_block=rates.transfer_ms_per_block,
        transfer_overhead_ms=rates.transfer_overhead_ms))


BAD_REPORTS = {
    "infinite prefill rate": dict(prefill_tokens_per_s=INF, num_prefills=1),
    "denormal prefill rate": dict(prefill_tokens_per_s=1e-320, num_prefills=1),
    "nan prefill rate": dict(prefill_tokens_per_s=NAN, num_prefills=1),
    "infinite transfer rate": dict(transfer_bytes_per_s=INF, num_transfers=1, block_bytes=4096),
    "negative transfer overhead": dict(transfer_bytes_per_s=1e9, num_transfers=1, block_bytes=4096,
                                       transfer_overhead_ms=-1e9),
    "nan transfer overhead": dict(transfer_bytes_per_s=1e9, num_transfers=1, block_bytes=4096,
                                  transfer_overhead_ms=NAN),
    "block bytes 2^64-1 over a tiny rate": dict(transfer_bytes_per_s=1e-300, num_transfers=1,
                                                block_bytes=2**64 - 1),
}


@pytest.mark.parametrize("pool_used_blocks", [0, 50])
@pytest.mark.parametrize("name", sorted(BAD_REPORTS))
def test_a_non_finite_or_negative_measured_rate_never_prices_a_pause(name, pool_used_blocks):
    """Every option's price stays finite and >= 0, and a rate that is not a finite positive
    number counts as not measured (the configured cost prices that option); a NaN or
    negative per-transfer overhead counts as none."""
    plan = _decide(events_pb2.LoadReport(num_blocks=100, num_free_blocks=50, **BAD_REPORTS[name]),
                   pool_used_blocks)
    for option, cost in plan.costs_ms:
        assert math.isfinite(cost) and cost >= 0, (name, option, cost)
    if "overhead" not in name:  # the rate itself is broken: priced as not measured
        assert plan.cost_source == "configured", (name, plan.cost_source, plan.costs_ms)


# -- pins and tenants' reserved shares --------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), preset="tiny")


def _prompt(n: int, start: int) -> list[int]:
    return [(start + 7 * i) % 1000 for i in range(n)]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _run(engine: LLMEngine) -> dict:
    done = {}
    for _ in range(400):
        if not engine.has_unfinished_requests:
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    raise AssertionError("engine busy after 400 steps")


def test_a_pin_inside_its_tenants_reserved_share_survives_another_tenants_request(checkpoint):
    """Tenant A reserves 8 of 20 blocks and keeps 7 of them pinned for a paused session;
    tenant B may borrow the other 12. B's request that grows past 12 blocks can never use
    A's reserved blocks, pinned or not: releasing A's pin gains B nothing and costs A its
    context (here B ends as a length stop either way)."""
    engine = LLMEngine(checkpoint, EngineConfig(num_kv_blocks=20, block_size=BS))
    engine.set_partitions([PartitionSpec("A", reserved_blocks=8), PartitionSpec("B", credit_blocks=20)])
    engine.add_request("a", _prompt(28, 100), _greedy(1), partition="A",
                       session=SessionOptions("a-session", pin_ttl_s=60.0))
    _run(engine)
    assert engine.pins.num_pinned_blocks == 7
    engine.add_request("b", _prompt(8, 5), _greedy(60), partition="B")  # wants 17 blocks
    _run(engine)
    assert "a-session" in engine.pins  # fails: B's request released it (old code too)


# -- an ended session's blocks in the eviction line -------------------------------------
def test_ending_a_session_never_queues_a_prefix_other_cached_contexts_continue_ahead_of_them(checkpoint):
    """Sessions A and B share a 4-block system prompt; B is idle with its blocks cached
    (drop), A is pinned and then ended. A's own 3 blocks may go first, but the shared
    prompt must not be evicted before B's tail: once it goes, B's cached blocks are
    unreachable (a prefix hit stops at the first miss) yet still take room."""
    engine = LLMEngine(checkpoint, EngineConfig(num_kv_blocks=24, block_size=BS))
    system = _prompt(16, 1)
    b_context = system + _prompt(8, 500)
    engine.add_request("b", b_context, _greedy(1), session=SessionOptions("b"))
    _run(engine)
    # B's 6 full blocks, freed tail first: the free-cached queue reversed is its chain
    b_hashes = [blk.block_hash for blk in reversed(engine.pool._free_cached.values())]
    assert len(b_hashes) == 6
    engine.add_request("a", system + _prompt(12, 800), _greedy(1), session=SessionOptions("a", pin_ttl_s=60.0))
    _run(engine)
    engine.release_session("a")  # EndSession
    num_uncached = engine.pool.num_free_blocks - len(engine.pool._free_cached)
    engine.add_request("n", _prompt((num_uncached + 4) * BS - 1, 300), _greedy(1))  # A's 3 + one more
    _run(engine)
    resident = [engine.pool.contains(h) for h in b_hashes]
    reachable = len(engine.pool.get_cached_blocks(b_hashes))
    # fails: shared block 4 evicted, B's blocks 5-6 resident but unreachable ([T,T,T,F,T,T])
    assert reachable == sum(resident), resident


# -- a quota cut releases another partition's pin ------------------------------------------
PREFIXES = [[(p * 131 + 7 * i) % 1000 for i in range(12)] for p in range(3)]


def test_a_hop_cut_at_its_own_quota_never_releases_another_partitions_pin(checkpoint):
    """A's hop grows past A's quota (8 blocks): no pin outside A can help it, yet
    _requeue_if_pins_yield falls back to release_for(None, ...) and drops B's pin."""
    engine = LLMEngine(checkpoint, EngineConfig(num_kv_blocks=24, block_size=BS))
    engine.set_partitions([PartitionSpec("A", credit_blocks=8), PartitionSpec("B", credit_blocks=24)])
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.add_request("b", PREFIXES[1] + [5] * 8, greedy, partition="B", session=SessionOptions("sb", pin_ttl_s=60.0))
    engine.add_request("a", PREFIXES[0] + [9] * 8, greedy, partition="A", session=SessionOptions("sa", pin_ttl_s=60.0))
    _run(engine)
    assert "sa" in engine.pins and "sb" in engine.pins
    engine.add_request("a-1", PREFIXES[0] + [9] * 8 + [3] * 4, SamplingParams(max_tokens=12, temperature=0.0,
                       ignore_eos=True), partition="A", session=SessionOptions("sa"))
    _run(engine)
    assert "sb" in engine.pins  # fails on main (and before 4abc6b4)


# -- a pin whose blocks the requester itself holds is released for nothing ----------------
def test_a_forked_childs_hop_never_releases_its_parents_pin_when_that_frees_no_block(checkpoint):
    """Parent session "p" is pinned (5 blocks, back last); its forked child's hop hits all 5
    by reference and grows; idle session "o" is pinned too (3 blocks, back sooner). When
    the child needs a block, releasing "p" frees none (the child holds them all), yet
    release_for counts its 5 blocks as freed and drops it first; only "o" helps."""
    engine = LLMEngine(checkpoint, EngineConfig(num_kv_blocks=16, block_size=BS))
    parent = _prompt(20, 40)
    engine.add_request("p", parent, _greedy(1), session=SessionOptions("p", pin_ttl_s=600.0))
    engine.add_request("o", _prompt(12, 900), _greedy(1), session=SessionOptions("o", pin_ttl_s=5.0))
    _run(engine)
    assert engine.pins.num_pinned_blocks == 8
    engine.add_request("c", parent + _prompt(3, 77), _greedy(34), session=SessionOptions("c"))
    out = _run(engine)["c"]
    assert out.num_cached_tokens == 20
    assert "o" not in engine.pins  # it had to yield
    assert "p" in engine.pins  # fails: released first, though that freed nothing


# -- EndSession of a session this tenant never had --------------------------------------
def _steps():
    import asyncio  # noqa: F401
    from services.scheduler.agent_plane import AgentPlane
    from services.scheduler.dispatch.agent_steps import AgentSteps
    from services.scheduler.policy.admission import Admission
    from services.scheduler.policy.contracts import ContractBook
    from services.scheduler.policy.intent_shift import make_intent_detector
    from services.scheduler.policy.pause import make_pause_policy
    from services.scheduler.policy.placement import InflightTracker
    from services.scheduler.policy.priority import make_prioritizer
    from services.scheduler.state.membership import ExecutorRecord, ExecutorState, Membership

    class Port:
        def __init__(self):
            self.released = []

        async def release_session(self, address, sid, hashes):
            self.released.append(sid)

    membership = Membership()
    membership.heartbeat(ExecutorRecord(name="a", address="a", model_id="m", block_size=16,
                                        state=ExecutorState.SERVING, num_blocks=100))
    port = Port()
    plane = AgentPlane(make_prioritizer("weft"), make_pause_policy("cost"), ContractBook(),
                       make_intent_detector())
    return AgentSteps(plane, membership, port, Admission(4, 4), InflightTracker()), port


def test_ending_a_session_the_tenant_never_had_is_not_found_every_time_and_calls_no_executor():
    """First EndSession of an unknown id: None (NOT_FOUND). The same call again must be
    NOT_FOUND too; on main it succeeds (SessionTable.end recorded the unknown id as ended)
    and fans a release out to every executor. A storm of random ids from one tenant also
    pushes other tenants' recently-ended records out of the shared bounded table."""
    import asyncio
    steps, port = _steps()
    assert asyncio.run(steps.end_session("mallory", "alice-session")) is None
    assert asyncio.run(steps.end_session("mallory", "alice-session")) is None  # fails
    assert port.released == []
