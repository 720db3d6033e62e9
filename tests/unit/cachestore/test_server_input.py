"""The CacheStore servicer against bad input and damaged storage (in-process server,
no model): clear INVALID_ARGUMENT naming the field, misses for unknown or corrupt
blocks, never wrong bytes."""
from __future__ import annotations

import asyncio
import os

import grpc
import pytest

from services.cachestore.blocks import checksum
from services.cachestore.disk_tier import DiskTier
from services.cachestore.errors import ERROR_RULES
from services.cachestore.host_tier import HostTier
from services.cachestore.server import CacheStoreServicer
from services.cachestore.tiers import TieredStore, TierPolicyName, make_tier_policy
from services.mesh.grpc_server import GrpcServer
from weft.v1 import cachestore_pb2, cachestore_pb2_grpc

MAX_BLOCK = 64 << 10


def header(h: int, payload: bytes, **over) -> cachestore_pb2.BlockHeader:
    fields = dict(block_hash=h, dtype="uint8", shape=[len(payload)], size_bytes=len(payload),
                  checksum=checksum(payload), model_id="m", block_size=16)
    fields.update(over)
    return cachestore_pb2.BlockHeader(**fields)


def chunks(*items):
    for item in items:
        yield cachestore_pb2.PutBlocksChunk(**item)


async def with_stub(tmp_path, fn, host_bytes=1 << 20):
    store = TieredStore(HostTier(host_bytes), DiskTier(tmp_path, 1 << 20, fsync=False),
                        make_tier_policy(TierPolicyName.DEMOTE_ON_EVICT))
    server = GrpcServer("weft.v1.CacheStore", "127.0.0.1", 0, rules=ERROR_RULES, grace_s=0.1)
    cachestore_pb2_grpc.add_CacheStoreServicer_to_server(CacheStoreServicer(store, MAX_BLOCK, 1 << 12), server.server)
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            await fn(cachestore_pb2_grpc.CacheStoreStub(ch), store)
    finally:
        await server.server.stop(0)


async def get_all(stub, hashes):
    got, missing, current = {}, [], None
    async for c in stub.GetBlocks(cachestore_pb2.GetBlocksRequest(block_hashes=hashes)):
        which = c.WhichOneof("chunk")
        if which == "header":
            current = c.header.block_hash
            got[current] = b""
        elif which == "data":
            got[current] += c.data
        else:
            missing.append(c.missing_block_hash)
    return got, missing


BAD_STREAMS = {
    "oversized": ([{"header": header(1, b"x" * 10, size_bytes=MAX_BLOCK + 1, shape=[MAX_BLOCK + 1])}],
                  "header.size_bytes"),
    "shape_disagrees": ([{"header": header(1, b"x" * 10, shape=[11])}], "header.size_bytes"),
    "unknown_dtype": ([{"header": header(1, b"x" * 10, dtype="complex64")}], "header.dtype"),
    "data_before_header": ([{"data": b"xx"}], "data"),
    "too_many_bytes": ([{"header": header(1, b"x" * 10)}, {"data": b"x" * 11}], "data"),
    "truncated": ([{"header": header(1, b"x" * 10)}, {"data": b"x" * 9}], "data"),
    "checksum": ([{"header": header(1, b"x" * 10, checksum=1)}, {"data": b"x" * 10}], "header.checksum"),
    "empty_chunk": ([{}], "chunk"),
}


@pytest.mark.parametrize("case", sorted(BAD_STREAMS))
def test_malformed_put_streams_are_invalid_argument_naming_the_field(tmp_path, case):
    items, field = BAD_STREAMS[case]

    async def check(stub, store):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.PutBlocks(chunks(*items))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(field)
        assert store.tier_of(1) is None  # nothing half-stored
    asyncio.run(with_stub(tmp_path, check))


def test_unknown_and_corrupt_blocks_are_misses_never_wrong_bytes(tmp_path):
    async def check(stub, store):
        good, bad = os.urandom(5000), os.urandom(5000)
        reply = await stub.PutBlocks(chunks({"header": header(1, good)}, {"data": good},
                                            {"header": header(2, bad)}, {"data": bad}))
        assert reply.num_stored == 2
        # RAM holds one block, so block 1 went to disk; damage its file on disk.
        path = store.disk.path_of(1)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        got, missing = await get_all(stub, [1, 2, 99])
        assert got == {2: bad} and missing == [1, 99]
        assert not path.exists()
    asyncio.run(with_stub(tmp_path, check, host_bytes=6000))


def test_full_store_is_resource_exhausted(tmp_path, monkeypatch):
    async def check(stub, store):
        def no_space(*_a, **_k):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "replace", no_space)
        payload = os.urandom(5000)  # larger than RAM, and the disk refuses it
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.PutBlocks(chunks({"header": header(5, payload)}, {"data": payload}))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        got, missing = await get_all(stub, [5])
        assert got == {} and missing == [5]
    asyncio.run(with_stub(tmp_path, check, host_bytes=1000))


def test_prefetch_warms_an_archived_prefix_into_host_ram(tmp_path):
    from services.cachestore.blocks import Block, BlockMeta
    from services.cachestore.disk_demotion import AgeDemotion
    from services.cachestore.tiers import Tier
    from services.shared.block_hash import extra_keys_for, hash_block_chain

    async def go():
        store = TieredStore(HostTier(1 << 20), DiskTier(tmp_path, 1 << 20, fsync=False),
                            make_tier_policy(TierPolicyName.DEMOTE_ON_EVICT), AgeDemotion(max_idle_s=-1))
        tokens = list(range(64))
        hashes = hash_block_chain(tokens, 16, extra_keys_for("m", "acme"))
        for h in hashes[:3]:
            payload = os.urandom(100)
            store.put(Block(BlockMeta(h, "uint8", (100,), 100, checksum(payload), "m", 16), payload))
        store.sweep()  # everything archived
        assert all(store.tier_of(h) is Tier.ARCHIVED for h in hashes[:3])
        servicer = CacheStoreServicer(store, MAX_BLOCK, 1 << 12)
        reply = await servicer.PrefetchBlocks(cachestore_pb2.PrefetchBlocksRequest(tenant="acme", token_ids=tokens),
                                              None)
        assert (reply.num_found_blocks, reply.num_warmed_blocks) == (3, 3)
        assert all(store.tier_of(h) is Tier.SLEEPING for h in hashes[:3])
        other = await servicer.PrefetchBlocks(cachestore_pb2.PrefetchBlocksRequest(tenant="globex", token_ids=tokens),
                                              None)
        assert other.num_found_blocks == 0  # another tenant's salt: different hashes
    asyncio.run(go())
