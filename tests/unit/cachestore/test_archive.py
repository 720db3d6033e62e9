"""CacheStore.ArchiveBlocks: released KV moves from host RAM down to disk at once, stays
readable there, and is never dropped (no disk tier, or a failed write, leaves it in RAM)."""
from __future__ import annotations

import asyncio
import os

import grpc

from services.cachestore.blocks import Block, BlockMeta, checksum
from services.cachestore.disk_tier import DiskTier
from services.cachestore.errors import ERROR_RULES
from services.cachestore.host_tier import HostTier
from services.cachestore.server import CacheStoreServicer
from services.cachestore.tiers import ArchiveResult, Tier, TieredStore, TierPolicyName, make_tier_policy
from services.mesh.grpc_server import GrpcServer
from weft.v1 import cachestore_pb2, cachestore_pb2_grpc, events_pb2


def block(h: int, size: int = 1024) -> Block:
    payload = os.urandom(size)
    return Block(BlockMeta(h, "uint8", (size,), size, checksum(payload), "m", 16), payload)


def store(tmp_path, disk: bool = True) -> TieredStore:
    return TieredStore(HostTier(1 << 20), DiskTier(tmp_path, 1 << 20, fsync=False) if disk else None,
                       make_tier_policy(TierPolicyName.DEMOTE_ON_EVICT))


def test_archive_moves_host_blocks_to_disk_and_counts_each_hash_once(tmp_path):
    s = store(tmp_path)
    for h in (1, 2):
        s.put(block(h))
    s.take_changes()
    assert s.archive([1, 1, 2, 3]) == ArchiveResult(num_archived=2, num_already_archived=0, num_missing=1,
                                                    num_kept=0)
    assert s.tier_of(1) is Tier.ARCHIVED and s.tier_of(2) is Tier.ARCHIVED and len(s.host) == 0
    moves = {(c.tier, c.stored, h) for c in s.take_changes() for h in c.block_hashes}
    assert moves == {(t, stored, h) for h in (1, 2) for t, stored in ((Tier.ARCHIVED, True), (Tier.SLEEPING, False))}
    assert s.archive([1]).num_already_archived == 1  # a second archive is a no-op


def test_an_archived_block_is_still_readable(tmp_path):
    s = store(tmp_path)
    b = block(7)
    s.put(b)
    s.archive([7])
    assert s.get(7) == b


def test_without_a_disk_tier_archive_leaves_blocks_in_ram(tmp_path):
    s = store(tmp_path, disk=False)
    s.put(block(1))
    assert s.archive([1]).num_kept == 1 and s.tier_of(1) is Tier.SLEEPING


def test_a_failed_disk_write_keeps_the_block_in_ram(tmp_path, monkeypatch):
    s = store(tmp_path)
    s.put(block(1))

    def fail(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    assert s.archive([1]).num_kept == 1 and s.tier_of(1) is Tier.SLEEPING


def test_archive_blocks_over_grpc_reports_the_archived_tier(tmp_path):
    async def run():
        s = store(tmp_path)
        s.put(block(11))
        server = GrpcServer("weft.v1.CacheStore", "127.0.0.1", 0, rules=ERROR_RULES, grace_s=0.1)
        cachestore_pb2_grpc.add_CacheStoreServicer_to_server(CacheStoreServicer(s, 1 << 20, 1 << 16), server.server)
        port = await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = cachestore_pb2_grpc.CacheStoreStub(ch)
                reply = await stub.ArchiveBlocks(cachestore_pb2.ArchiveBlocksRequest(block_hashes=[11, 12]))
                tiers = await stub.Contains(cachestore_pb2.ContainsRequest(block_hashes=[11]))
                return reply, list(tiers.tiers)
        finally:
            await server.server.stop(0)

    reply, tiers = asyncio.run(run())
    assert (reply.num_archived_blocks, reply.num_missing_blocks) == (1, 1)
    assert tiers == [events_pb2.TIER_ARCHIVED]
