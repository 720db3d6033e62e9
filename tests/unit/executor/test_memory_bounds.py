"""Containers that grow per request or per block hash stay bounded after many requests
(soak memory creep, reliability issue 7): each has a removal path or a cap."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from services.executor.engine.step_trace import StepTrace
from services.mesh.timeline import Trace, TimelineStore
from services.scheduler.state.kv_index import KvIndex

NUM_REQUESTS = 20_000


# -- scheduler: the KV index ------------------------------------------------------------
def test_executor_entries_leave_the_index_when_their_blocks_are_removed():
    index = KvIndex()
    for i in range(NUM_REQUESTS):  # every request a distinct prompt: 3 fresh block hashes
        hashes = [i * 3 + j for j in range(3)]
        index.stored("executor-0", hashes)
        if i >= 100:  # the executor's pool evicts the blocks of request i - 100
            index.removed("executor-0", [(i - 100) * 3 + j for j in range(3)])
    assert index.num_hashes() == (300, 0)
    assert index.num_blocks("executor-0") == 300
    assert index.drop_source("executor-0") == 300 and index.num_hashes() == (0, 0)


def test_cachestore_entries_are_capped_and_the_least_recently_stored_forgotten_first():
    index = KvIndex(max_store_blocks=1000)
    for i in range(NUM_REQUESTS):
        index.store_stored("cachestore", "archived", [i * 2, i * 2 + 1])
        index.store_stored("cachestore", "sleeping", [0])  # re-stored all along: stays
    assert index.num_hashes() == (0, 1000)
    assert index.num_store_forgotten == NUM_REQUESTS * 2 - 1000  # distinct hashes beyond the cap
    last = 2 * NUM_REQUESTS - 1
    assert index.num_store_blocks([last - 1, last]) == 2 and index.num_store_blocks([2, 3]) == 0
    assert index.store_tiers(0) == {"archived", "sleeping"}
    assert index.drop_store("cachestore") == 1001  # the per-source set shrank with the cap (hash 0 in two tiers)
    assert index.num_hashes() == (0, 0)


def test_cachestore_entries_are_unbounded_only_when_asked():
    index = KvIndex(max_store_blocks=0)
    index.store_stored("cachestore", "archived", range(5000))
    assert index.num_hashes() == (0, 5000) and index.num_store_forgotten == 0
    with pytest.raises(ValueError):
        KvIndex(max_store_blocks=-1)


# -- executor: per-request step records -------------------------------------------------
def _engine(waiting):
    from services.executor.kv.block_pool import BlockPool
    from services.executor.kv.manager import KVCacheManager

    pool = BlockPool(100, 16, enable_prefix_caching=True)
    return SimpleNamespace(pool=pool, kv=KVCacheManager(pool), num_blocks=100,
                           scheduler=SimpleNamespace(waiting=waiting), config=SimpleNamespace(max_prefill_chunk=0))


def _item(rid: str):
    return SimpleNamespace(seq=SimpleNamespace(request_id=rid, num_tokens=8, num_computed_tokens=0),
                           num_new_tokens=8)


def test_step_records_of_finished_requests_are_popped():
    trace = StepTrace("executor-0", update_gauges_every=1_000_000)
    engine = _engine([])
    for i in range(NUM_REQUESTS):
        trace.on_step(engine, SimpleNamespace(decodes=[], prefills=[_item(f"r{i}")], preempted=[]), 0, 1)
        assert trace.pop(f"r{i}").chunks == [[0, 1, 8]]
    assert len(trace) == 0


def test_records_a_step_recreates_after_a_cancelled_stream_popped_them_are_capped():
    trace = StepTrace("executor-0", update_gauges_every=1_000_000, max_records=64)
    for i in range(NUM_REQUESTS):
        rid = f"r{i}"
        trace.pop(rid)  # the cancelled stream forgets its record ...
        seq = _item(rid).seq  # ... while a step in flight still sees the request waiting
        trace.on_step(_engine([seq]), SimpleNamespace(decodes=[], prefills=[], preempted=[]), 0, 1)
    assert len(trace) == 64
    assert trace.pop(f"r{NUM_REQUESTS - 1}").queued_ns == 1  # the newest survive


# -- router: timelines --------------------------------------------------------------------
def test_the_timeline_store_keeps_only_its_capacity_of_requests():
    store = TimelineStore(capacity=128)
    for i in range(NUM_REQUESTS // 4):
        Trace(f"r{i}", "router").finish(store)
    assert len(store) == 128
    assert store.get("r0") is None and store.get(f"r{NUM_REQUESTS // 4 - 1}") is not None


# -- executor: requests tracked for demote-on-finish ------------------------------------
class _HangingEngine:
    """An AsyncEngine stand-in whose requests never produce output."""

    async def generate(self, request_id, *args, **kwargs):
        await asyncio.Event().wait()
        yield  # pragma: no cover

    def abort(self, request_id: str) -> None:
        pass


class _Context:
    def invocation_metadata(self):
        return ()

    def time_remaining(self):
        return None


def test_cancelled_streams_leave_nothing_tracked_for_demotion():
    from services.executor.tiers.offload import DemoteOnFinish
    from services.executor.server import ExecutorServicer
    from services.executor.tiers.tier_ops import TierOps
    from weft.v1 import executor_pb2

    async def go():
        servicer = ExecutorServicer(_HangingEngine(), "executor-0", "tiny", 16,
                                    tiers=TierOps(None, None, DemoteOnFinish.ALL, promote_before_prefill=False))
        for i in range(200):
            stream = servicer.Generate(executor_pb2.ExecuteRequest(request_id=f"r{i}", prompt_token_ids=[1, 2, 3]),
                                       _Context())
            first = asyncio.ensure_future(anext(stream))
            for _ in range(100):  # until the pump registered the request (no sleeps as sync)
                if f"r{i}" in servicer.tiers._tracked:
                    break
                await asyncio.sleep(0)
            assert f"r{i}" in servicer.tiers._tracked
            first.cancel()  # the client goes away
            with pytest.raises(asyncio.CancelledError):
                await first
            await stream.aclose()
        assert servicer.tiers._tracked == {} and servicer._streams == {}

    asyncio.run(go())


# -- executor: the prefix cache's metadata ----------------------------------------------
def test_prefix_cache_metadata_stops_growing_once_the_pool_is_full():
    """Distinct prompts register fresh hashes until every block holds one; from then on
    each new hash evicts an old one, so the pool's maps plateau at the pool size (the
    soak's residual executor creep: ~330 bytes per hash, 32k hashes in the default pool)."""
    from services.executor.kv.block_pool import BlockPool
    from services.executor.kv.manager import KVCacheManager
    from services.executor.engine.sampling_params import SamplingParams
    from services.executor.engine.sequence import Sequence

    pool = BlockPool(num_blocks=256, block_size=4)
    kv = KVCacheManager(pool)
    num_cached = []
    for i in range(NUM_REQUESTS // 4):
        seq = Sequence(f"r{i}", [i, i + 1, i + 2, 7, 7, 7, 7, 7, 7, 9, 9, 9, 9], SamplingParams())
        assert kv.allocate_slots(seq, seq.num_tokens, kv.match_prefix(seq))
        seq.num_computed_tokens = seq.num_tokens
        kv.cache_computed_blocks(seq)  # 3 full blocks (+ a partial one), each a new hash
        kv.free(seq)
        pool.take_events()  # the executor publishes them every step
        num_cached.append(len(pool.cached_hashes()))
    assert num_cached[10] == 33  # filling: 3 hashes per request
    assert num_cached[200] == max(num_cached) == num_cached[-1] <= 256  # full by then: a plateau
    assert len(pool._cached) + len(pool._free_cached) + len(pool._free_uncached) <= 3 * 256
    assert pool.num_free_blocks == 256 and kv._num_registered == {}
