"""A block file on disk whose JSON header has the wrong types (issue 12: ``"shape": 7``
failed the whole GetBlocks batch with INTERNAL and stayed on disk). Every such file is a
corrupt block: a miss in an otherwise served batch, deleted, counted. Driven through the
real servicer over gRPC, headers hand-written into the archived tier's files."""
from __future__ import annotations

import asyncio
import json
import os
import struct

import grpc
import pytest

from services.cachestore.blocks import Block, BlockMeta, checksum
from services.cachestore.disk_tier import DiskTier
from services.cachestore.errors import ERROR_RULES
from services.cachestore.host_tier import HostTier
from services.cachestore.server import CacheStoreServicer
from services.cachestore.tiers import TieredStore, TierPolicyName, make_tier_policy
from services.mesh.grpc_server import GrpcServer
from weft.v1 import cachestore_pb2, cachestore_pb2_grpc

GOOD, BAD = 0x11, 0x22
PAYLOAD_BYTES = 64  # float16 [4, 8]

# field -> a wrong value (one field broken per case); None deletes the field.
BAD_FIELDS = {
    "shape_is_int": ("shape", 7),
    "shape_is_string": ("shape", "4,8"),
    "shape_of_strings": ("shape", ["4", "8"]),
    "shape_negative": ("shape", [-4, -8]),
    "shape_of_bools": ("shape", [True, 64]),
    "shape_beyond_uint32": ("shape", [1 << 40, 0]),
    "shape_empty": ("shape", []),
    "shape_disagrees_with_size": ("shape", [4, 4]),
    "dtype_is_int": ("dtype", 3),
    "dtype_unknown": ("dtype", "complex64"),
    "size_is_string": ("size_bytes", "64"),
    "size_is_float": ("size_bytes", 64.0),
    "checksum_null": ("checksum", None),
    "checksum_is_list": ("checksum", [1]),
    "hash_is_string": ("block_hash", str(BAD)),
    "hash_negative": ("block_hash", -BAD),
    "model_id_is_int": ("model_id", 5),
    "block_size_negative": ("block_size", -16),
    "pause_beyond_uint32": ("expected_pause_ms", 1 << 40),
    "priority_is_string": ("priority", "high"),
    "dtype_missing": ("dtype", None),
}


def block(block_hash: int) -> Block:
    payload = os.urandom(PAYLOAD_BYTES)
    return Block(BlockMeta(block_hash, "float16", (4, 8), PAYLOAD_BYTES, checksum(payload), "m", 16), payload)


def rewrite_header(disk: DiskTier, block_hash: int, edit) -> None:
    """Replace the JSON header of a block file, keeping its payload."""
    path = disk.path_of(block_hash)
    data = path.read_bytes()
    magic, meta_len = struct.unpack_from("<8sI", data)
    record = json.loads(data[12:12 + meta_len])
    record = edit(record)
    meta = json.dumps(record).encode()
    path.write_bytes(struct.pack("<8sI", magic, len(meta)) + meta + data[12 + meta_len:])


async def get_blocks(stub, hashes) -> tuple[dict[int, bytes], list[int]]:
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


def serve_and_get(tmp_path, edit) -> tuple[dict[int, bytes], list[int], DiskTier, int, dict[int, bytes]]:
    """Two blocks on disk only (host RAM holds nothing), BAD's header edited; one GetBlocks
    of [BAD, GOOD, BAD]. Returns (got, missing, disk, Stats.num_corrupt_blocks, written)."""
    disk = DiskTier(tmp_path, 1 << 20, fsync=False)
    written = {h: block(h) for h in (GOOD, BAD)}
    for b in written.values():
        disk.put(b)
    rewrite_header(disk, BAD, edit)
    store = TieredStore(HostTier(0), DiskTier(tmp_path, 1 << 20, fsync=False),  # rebuilt from the files
                        make_tier_policy(TierPolicyName.DEMOTE_ON_EVICT))

    async def run():
        server = GrpcServer("weft.v1.CacheStore", "127.0.0.1", 0, rules=ERROR_RULES, grace_s=0.1)
        cachestore_pb2_grpc.add_CacheStoreServicer_to_server(CacheStoreServicer(store, 1 << 16, 1 << 12),
                                                             server.server)
        port = await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = cachestore_pb2_grpc.CacheStoreStub(ch)
                got, missing = await get_blocks(stub, [BAD, GOOD, BAD])
                stats = await stub.Stats(cachestore_pb2.CacheStatsRequest())
                return got, missing, stats.num_corrupt_blocks
        finally:
            await server.server.stop(0)

    got, missing, num_corrupt = asyncio.run(run())
    return got, missing, store.disk, num_corrupt, {h: b.payload for h, b in written.items()}


def broken(field: str, value):
    def edit(record: dict):
        if value is None and field != "checksum":
            record.pop(field)
        else:
            record[field] = value
        return record
    return edit


@pytest.mark.parametrize("case", sorted(BAD_FIELDS))
def test_a_header_with_a_wrong_json_type_is_a_miss_and_is_deleted_while_the_batch_is_served(tmp_path, case):
    got, missing, disk, num_corrupt, written = serve_and_get(tmp_path, broken(*BAD_FIELDS[case]))
    assert got == {GOOD: written[GOOD]}  # the rest of the batch is served, byte for byte
    assert missing == [BAD, BAD]  # a miss, and still a miss when asked again
    assert not disk.path_of(BAD).exists() and not disk.contains(BAD)
    assert num_corrupt == 1


@pytest.mark.parametrize("record", [[1, 2, 3], "a string", 7, None], ids=["list", "string", "number", "null"])
def test_a_header_that_is_not_a_json_object_is_a_miss_and_is_deleted(tmp_path, record):
    got, missing, disk, num_corrupt, written = serve_and_get(tmp_path, lambda _: record)
    assert got == {GOOD: written[GOOD]} and missing == [BAD, BAD]
    assert not disk.path_of(BAD).exists() and num_corrupt == 1


def test_an_untouched_header_round_trips(tmp_path):
    """The control: the same path with the header rewritten as it was serves both blocks."""
    got, missing, disk, num_corrupt, written = serve_and_get(tmp_path, lambda record: record)
    assert got == written and missing == [] and num_corrupt == 0
