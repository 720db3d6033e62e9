"""Agent sessions inside the executor, without processes: pinning a paused session's
blocks (keep), TTL expiry and release, per-task KV quota, entropy reporting, and the
tenant credit audit that decays borrowing."""
from __future__ import annotations

import pytest

from services.shared.block_hash import hash_block_chain
from services.executor.kv.block_pool import BlockPool, PartitionSpec, PartitionUsage
from services.executor.engine.engine import LLMEngine
from services.executor.engine.config import EngineConfig
from services.executor.errors import InvalidRequestError
from services.executor.kv.pinning import PinTable
from services.executor.policy.credit_audit import CreditAuditor, parse_partitions
from services.executor.engine.sampling_params import SamplingParams
from services.executor.engine.sequence import FinishReason, SessionOptions
from weft.testing.tiny_model import make_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _cached_blocks(pool: BlockPool, n: int, start: int = 0):
    hashes = hash_block_chain(list(range(start, start + n * BS)), BS, b"t")
    blocks = pool.allocate(n)
    pool.cache_full_blocks(blocks, hashes, None)
    return blocks, hashes


# -- pinning (pool only) -----------------------------------------------------------
def test_pinned_blocks_survive_a_flood_that_evicts_unpinned_ones():
    pool = BlockPool(8, BS)
    pins = PinTable(pool)
    kept, kept_hashes = _cached_blocks(pool, 2, start=0)
    lost, lost_hashes = _cached_blocks(pool, 2, start=100)
    pins.pin("s1", kept, "default", ttl_s=10)
    pool.free(kept)
    pool.free(lost)
    assert pool.allocate(6) is not None  # the flood takes every evictable block
    assert all(pool.contains(h) for h in kept_hashes)
    assert not any(pool.contains(h) for h in lost_hashes)
    assert pool.allocate(1) is None  # pinned blocks are not for the taking


def test_pin_expires_after_its_ttl_and_release_frees_early():
    clock = Clock()
    pool = BlockPool(8, BS)
    pins = PinTable(pool, clock)
    a, _ = _cached_blocks(pool, 2)
    b, _ = _cached_blocks(pool, 1, start=50)
    pins.pin("a", a, "default", ttl_s=1.0)
    pins.pin("b", b, "default", ttl_s=5.0)
    pool.free(a)
    pool.free(b)
    assert pool.num_free_blocks == 5
    clock.now = 0.5
    assert pins.expire() == []
    clock.now = 1.0
    assert pins.expire() == ["a"]
    assert pool.num_free_blocks == 7 and "b" in pins
    assert pins.release("b") == 1 and pool.num_free_blocks == 8
    assert pins.release("b") == 0


def test_pin_skips_unhashed_blocks_and_charges_the_partition():
    pool = BlockPool(8, BS, partitions=[PartitionSpec("acme", 2, 2)])
    pins = PinTable(pool)
    blocks, _ = _cached_blocks(pool, 1)
    tail = pool.allocate(1)  # partial block: never hashed
    pool.free(blocks)
    pool.free(tail)
    blocks = blocks  # still cached
    assert pins.pin("s", blocks + tail, "acme", ttl_s=1) == 1
    assert pool.used_blocks("acme") == 1


# -- credit audit -----------------------------------------------------------------
def test_parse_partitions_reads_name_reserved_credit_and_rejects_garbage():
    assert parse_partitions("acme=4:2, globex=0:8") == [PartitionSpec("acme", 4, 2), PartitionSpec("globex", 0, 8)]
    for bad in ("acme=4", "acme=x:1", "=1:1", "a=1:1,a=2:2"):
        with pytest.raises(ValueError):
            parse_partitions(bad)


def test_borrowing_tenant_credit_decays_each_audit_and_recovers_when_it_stops():
    auditor = CreditAuditor([PartitionSpec("flood", 2, 16), PartitionSpec("calm", 4, 4)], decay=0.5,
                            min_credit_fraction=0.25)
    borrowing = [PartitionUsage("flood", 10, 2, 16), PartitionUsage("calm", 1, 4, 4)]
    credits = []
    for _ in range(4):
        result = auditor.audit(borrowing)
        credits.append({s.name: s.credit_blocks for s in result.specs})
    assert [c["flood"] for c in credits] == [8, 4, 4, 4]  # floor: 25 % of 16
    assert all(c["calm"] == 4 for c in credits)  # not borrowing: untouched
    assert auditor.audit(borrowing).decayed == ()  # at the floor: nothing more to decay
    idle = [PartitionUsage("flood", 1, 2, 16)]
    assert [auditor.audit(idle).specs[0].credit_blocks for _ in range(3)] == [8, 16, 16]
    assert all(s.reserved_blocks in (2, 4) for s in auditor.audit(borrowing).specs)  # reservations never decay


# -- engine -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), preset="tiny")


def _engine(checkpoint, num_kv_blocks=24, **kw) -> LLMEngine:
    return LLMEngine(checkpoint, EngineConfig(num_kv_blocks=num_kv_blocks, block_size=BS, **kw))


def _run(engine: LLMEngine) -> dict:
    done = {}
    for _ in range(400):
        if not engine.has_unfinished_requests:
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    raise AssertionError("engine busy after 400 steps")


def _prompt(n: int, start: int) -> list[int]:
    return [(start + 7 * i) % 1000 for i in range(n)]


def test_kept_session_hits_its_whole_context_after_a_flood(checkpoint):
    for pin in (True, False):
        engine = _engine(checkpoint)
        ctx = _prompt(30, 1)
        ses = SessionOptions("s1", pin_ttl_s=60.0 if pin else 0.0)
        engine.add_request("hop0", ctx, GREEDY, session=ses)
        _run(engine)
        for i in range(4):  # other traffic cycles the pool
            engine.add_request(f"flood{i}", _prompt(60, 500 + 97 * i), GREEDY)
            _run(engine)
        engine.add_request("hop1", ctx + [5, 6, 7, 8], GREEDY, session=SessionOptions("s1"))
        out = _run(engine)["hop1"]
        if pin:
            assert out.num_cached_tokens == 28  # every full block of the shared 30-token context
            assert engine.pins.num_pinned_blocks == 0  # the hop without keep released the pin
        else:
            assert out.num_cached_tokens == 0


def test_task_kv_quota_ends_generation_at_the_quota_and_refuses_larger_prompts(checkpoint):
    engine = _engine(checkpoint)
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    engine.add_request("q", _prompt(10, 3), params, session=SessionOptions(kv_quota_blocks=4))
    out = _run(engine)["q"]
    assert out.finish_reason is FinishReason.KV_QUOTA and out.num_prompt_tokens + out.num_output_tokens == 16
    with pytest.raises(InvalidRequestError, match="kv_quota_blocks"):
        engine.add_request("big", _prompt(20, 3), params, session=SessionOptions(kv_quota_blocks=4))


def test_sessions_report_mean_entropy_on_their_last_output(checkpoint):
    engine = _engine(checkpoint)
    engine.add_request("plain", _prompt(6, 1), GREEDY)
    engine.add_request("agent", _prompt(6, 1), GREEDY, session=SessionOptions("s", track_entropy=True))
    done = _run(engine)
    assert done["plain"].mean_entropy == 0.0
    assert 0.0 < done["agent"].mean_entropy <= 7.0  # ln(1024) ≈ 6.93 bounds it


def test_pins_yield_to_a_request_their_partition_could_not_otherwise_serve(checkpoint):
    engine = _engine(checkpoint, num_kv_blocks=40)
    engine.set_partitions([PartitionSpec("acme", 8, 4)])
    for i in range(2):  # two idle sessions pin 6 + 5 of acme's 12 blocks
        engine.add_request(f"s{i}", _prompt(24 - 4 * i, 40 + i), GREEDY, partition="acme",
                           session=SessionOptions(f"s{i}", pin_ttl_s=60.0))
        _run(engine)
    assert engine.pins.num_pinned_blocks == 11
    engine.add_request("live", _prompt(20, 9), GREEDY, partition="acme")
    out = _run(engine)["live"]
    assert out.num_output_tokens == 4 and out.finish_reason is FinishReason.LENGTH
    assert "s1" not in engine.pins and "s0" in engine.pins  # the pin expiring last went first


def test_priority_updates_reorder_the_waiting_queue(checkpoint):
    engine = _engine(checkpoint, max_num_seqs=1, preemption_policy="priority")
    for rid in ("a", "b", "c"):
        engine.add_request(rid, _prompt(6, ord(rid)), GREEDY)
    assert engine.update_priorities({"c": 5.0, "b": 1.0, "gone": 0.0}) == 2
    order = []
    for _ in range(200):
        if not engine.has_unfinished_requests:
            break
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["c", "b", "a"]


def test_an_ended_sessions_blocks_are_evicted_before_an_older_idle_context(checkpoint):
    engine = _engine(checkpoint, num_kv_blocks=10)
    older, ended = _prompt(16, 300), _prompt(16, 600)
    engine.add_request("older", older, GREEDY)  # no session: its blocks are freed first (LRU end)
    _run(engine)
    engine.add_request("ended", ended, GREEDY, session=SessionOptions("s", pin_ttl_s=60.0))
    _run(engine)
    assert engine.release_session("s") == (4, 0)
    engine.add_request("flood", _prompt(20, 900), GREEDY)  # 6 blocks: 2 free, 4 of the 8 cached evicted
    _run(engine)
    engine.add_request("older-again", older, GREEDY)
    engine.add_request("ended-again", ended, GREEDY)
    done = _run(engine)
    assert done["older-again"].num_cached_tokens == 12  # before: 0 (the most recently freed survived)
    assert done["ended-again"].num_cached_tokens == 0
