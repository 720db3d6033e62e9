"""KV demotion and promotion through real gRPC servers in this process: an executor
(tiny random model) and a cachestore (host RAM over a disk directory) on loopback.

Bit-identical round trips, greedy generation after promotion equal to recompute, and
the cached-token count that shows the promotion hit."""
from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from services.cachestore.disk_demotion import DemotionPolicyName, make_demotion_policy
from services.cachestore.disk_tier import DiskTier
from services.cachestore.errors import ERROR_RULES as STORE_RULES
from services.cachestore.host_tier import HostTier
from services.cachestore.server import CacheStoreServicer
from services.cachestore.tiers import TieredStore, TierPolicyName, make_tier_policy
from services.executor.engine.async_engine import AsyncEngine
from services.executor.engine.engine import LLMEngine
from services.executor.engine.config import EngineConfig
from services.executor.tiers.kv_transfer import export_blocks
from services.executor.server import ERROR_RULES as EXECUTOR_RULES
from services.executor.server import ExecutorServicer
from services.executor.tiers.tier_ops import build_tier_ops
from services.mesh.grpc_server import GrpcServer, channel_options
from weft.testing.tiny_model import make_tiny_checkpoint
from weft.v1 import cachestore_pb2_grpc, common_pb2, executor_pb2, executor_pb2_grpc

BLOCK_SIZE = 16
PROMPT = [(11 + 5 * i) % 1024 for i in range(120)]  # 7 full blocks usable for a hit
GREEDY = common_pb2.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-tiers"), preset="tiny", arch="llama")


@contextlib.asynccontextmanager
async def stack(checkpoint, disk_dir, host_capacity_bytes=1 << 20, demote_on_finish="never"):
    """(executor stub, store, servicer, engine) on free loopback ports; torn down on exit."""
    store = TieredStore(HostTier(host_capacity_bytes), DiskTier(disk_dir, 1 << 24, fsync=False),
                        make_tier_policy(TierPolicyName.DEMOTE_ON_EVICT),
                        make_demotion_policy(DemotionPolicyName.PAUSE_AWARE))
    store_server = GrpcServer("weft.v1.CacheStore", "127.0.0.1", 0, rules=STORE_RULES, grace_s=0.1)
    cachestore_pb2_grpc.add_CacheStoreServicer_to_server(CacheStoreServicer(store, 1 << 20, 1 << 14),
                                                         store_server.server)
    store_port = await store_server.start()
    engine = LLMEngine(checkpoint, EngineConfig(num_kv_blocks=32, block_size=BLOCK_SIZE, num_threads=1))
    async_engine = AsyncEngine(engine)
    tiers = build_tier_ops(async_engine, f"127.0.0.1:{store_port}", engine.model_id, BLOCK_SIZE, demote_on_finish)
    servicer = ExecutorServicer(async_engine, "executor-t", engine.model_id, BLOCK_SIZE, tiers=tiers)
    tiers.promoter.client.chunk_bytes = 1 << 12  # several data chunks per block
    exec_server = GrpcServer("weft.v1.Executor", "127.0.0.1", 0, rules=EXECUTOR_RULES, grace_s=0.1)
    executor_pb2_grpc.add_ExecutorServicer_to_server(servicer, exec_server.server)
    exec_port = await exec_server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{exec_port}", options=channel_options())
    try:
        yield executor_pb2_grpc.ExecutorStub(channel), store, servicer, engine
    finally:
        await channel.close()
        await tiers.promoter.client.close()
        await exec_server.server.stop(0)
        await store_server.server.stop(0)
        async_engine.shutdown()


async def generate(stub, rid, prompt=PROMPT, session_id=""):
    tokens, usage = [], None
    request = executor_pb2.ExecuteRequest(request_id=rid, prompt_token_ids=prompt, sampling=GREEDY)
    if session_id:
        request.session.session_id = session_id
    async for chunk in stub.Generate(request, timeout=60):
        tokens.extend(chunk.token_ids_delta)
        usage = chunk.usage
    return tokens, usage.num_cached_tokens


async def forget_local(servicer):
    await servicer.engine.call(lambda e: e.pool.evict_cached(e.pool.cached_hashes()))


def test_demote_then_promote_gives_bit_identical_kv(checkpoint, tmp_path):
    async def go():
        async with stack(checkpoint, tmp_path) as (stub, store, servicer, engine):
            await generate(stub, "a")
            hashes = servicer.tiers.promoter.prompt_hashes(PROMPT, "")
            before = await servicer.engine.call(lambda e: export_blocks(e, hashes))
            assert len(before) == len(hashes) == 7
            reply = await stub.DemoteBlocks(executor_pb2.DemoteBlocksRequest(block_hashes=hashes, evict_local=True))
            assert reply.num_demoted_blocks == 7 and reply.num_evicted_blocks == 7
            assert await servicer.engine.call(lambda e: e.pool.get_cached_blocks(hashes)) == []
            reply = await stub.PromoteBlocks(executor_pb2.PromoteBlocksRequest(token_ids=PROMPT, force=True))
            assert (reply.num_local_blocks, reply.num_promoted_blocks) == (0, 7)
            after = await servicer.engine.call(lambda e: export_blocks(e, hashes))
            assert [p.data for p in after] == [p.data for p in before]
            assert [p.shape for p in after] == [p.shape for p in before]
    asyncio.run(go())


def test_a_pause_demotion_keeps_the_local_copies_first_in_line_for_eviction(checkpoint, tmp_path):
    async def go():
        async with stack(checkpoint, tmp_path) as (stub, store, servicer, engine):
            tokens, _ = await generate(stub, "a")
            hashes = servicer.tiers.promoter.prompt_hashes(PROMPT, "")
            # the session's whole context, as the scheduler sends it: queueing only a prefix
            # of a resident chain would leave its continuation unreachable (BlockPool.queue_for_eviction)
            reply = await stub.DemoteBlocks(executor_pb2.DemoteBlocksRequest(token_ids=PROMPT + tokens,
                                                                             evict_first=True))
            assert reply.num_demoted_blocks == 8 and reply.num_evicted_blocks == 8  # queued, not forgotten
            assert len(await servicer.engine.call(lambda e: e.pool.get_cached_blocks(hashes))) == 7
            assert all(t is not None for t in await servicer.tiers.promoter.client.contains(hashes))
            _, cached = await generate(stub, "b")  # the resume finds them here: no load, no recompute
            assert cached == 7 * BLOCK_SIZE
    asyncio.run(go())


def test_greedy_generation_after_promotion_equals_recompute(checkpoint, tmp_path):
    async def go():
        async with stack(checkpoint, tmp_path, demote_on_finish="sessions") as (stub, store, servicer, engine):
            first, cached = await generate(stub, "s1-hop0", session_id="s1")
            assert cached == 0
            await servicer.tiers.drain()  # demote-on-finish wrote the session's blocks
            await forget_local(servicer)
            servicer.tiers.force_promotion = True  # the cost model has its own test
            promoted, cached = await generate(stub, "s1-hop0-again")
            assert cached == 7 * BLOCK_SIZE  # every usable prompt block came from the cachestore
            await forget_local(servicer)
            servicer.tiers.promote_before_prefill = False
            recomputed, cached = await generate(stub, "recompute")
            assert cached == 0
            assert promoted == recomputed == first
    asyncio.run(go())


def test_cost_model_recomputes_when_loading_is_slower(checkpoint, tmp_path):
    async def go():
        async with stack(checkpoint, tmp_path) as (stub, store, servicer, engine):
            await generate(stub, "a")
            hashes = servicer.tiers.promoter.prompt_hashes(PROMPT, "")
            await stub.DemoteBlocks(executor_pb2.DemoteBlocksRequest(token_ids=PROMPT, evict_local=True))
            servicer.tiers.promoter.cost.transfer_bytes_per_s = 1.0  # absurdly slow link
            reply = await stub.PromoteBlocks(executor_pb2.PromoteBlocksRequest(token_ids=PROMPT))
            assert reply.skipped_by_cost_model and reply.num_available_blocks == len(hashes)
            assert reply.num_promoted_blocks == 0
    asyncio.run(go())


def test_promotion_from_disk_after_host_tier_overflow(checkpoint, tmp_path):
    async def go():
        # RAM holds ~2 blocks (8 KiB each): the rest are archived to disk on RAM eviction.
        async with stack(checkpoint, tmp_path, host_capacity_bytes=20_000) as (stub, store, servicer, engine):
            first, _ = await generate(stub, "a")
            await stub.DemoteBlocks(executor_pb2.DemoteBlocksRequest(token_ids=PROMPT, evict_local=True))
            assert len(store.disk) >= 5
            reply = await stub.PromoteBlocks(executor_pb2.PromoteBlocksRequest(token_ids=PROMPT, force=True))
            assert reply.num_promoted_blocks == 7
            again, cached = await generate(stub, "b")
            assert again == first and cached == 7 * BLOCK_SIZE
    asyncio.run(go())


def test_unknown_hashes_are_missing_and_rpcs_without_cachestore_are_refused(checkpoint, tmp_path):
    async def go():
        async with stack(checkpoint, tmp_path) as (stub, store, servicer, engine):
            reply = await stub.DemoteBlocks(executor_pb2.DemoteBlocksRequest(block_hashes=[1, 2, 3]))
            assert (reply.num_demoted_blocks, reply.num_missing_blocks) == (0, 3)
            reply = await stub.PromoteBlocks(executor_pb2.PromoteBlocksRequest(token_ids=PROMPT, force=True))
            assert reply.num_available_blocks == 0 and reply.num_promoted_blocks == 0
            servicer.tiers = None
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.PromoteBlocks(executor_pb2.PromoteBlocksRequest(token_ids=PROMPT))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "cachestore_address" in err.value.details()
    asyncio.run(go())
