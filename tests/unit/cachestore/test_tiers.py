import os

import pytest

from services.cachestore.blocks import Block, BlockMeta, checksum
from services.cachestore.disk_tier import DiskTier
from services.cachestore.host_tier import HostTier
from services.cachestore.tiers import Tier, TieredStore, TierPolicyName, make_tier_policy


def block(h: int, size: int = 1024) -> Block:
    payload = os.urandom(size)
    return Block(BlockMeta(h, "uint8", (size,), size, checksum(payload), "m", 16), payload)


def test_host_tier_evicts_least_recently_used_to_fit_capacity():
    host = HostTier(capacity_bytes=3000)
    for h in (1, 2):
        assert host.put(block(h)) == []
    host.get(1)  # 2 is now least recent
    evicted = host.put(block(3))
    assert [b.block_hash for b in evicted] == [2]
    assert host.contains(1) and host.contains(3) and not host.contains(2)
    assert host.used_bytes == 2048 and host.num_evictions == 1
    assert host.put(block(4, size=5000)) is None  # never fits


def test_disk_write_is_atomic_and_round_trips(tmp_path):
    disk = DiskTier(tmp_path, capacity_bytes=1 << 20, fsync=False)
    b = block(0xAB)
    assert disk.put(b) == []
    assert disk.get(0xAB) == b
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert files == [disk.path_of(0xAB)]  # no temp file left behind


def test_failed_disk_write_leaves_no_block_and_no_temp_file(tmp_path, monkeypatch):
    disk = DiskTier(tmp_path, capacity_bytes=1 << 20, fsync=False)

    def fail(*_a, **_k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        disk.put(block(1))
    assert not disk.contains(1)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


@pytest.mark.parametrize("damage", ["flip_payload_byte", "truncate", "garbage"])
def test_corrupt_block_on_disk_is_a_miss_and_is_deleted(tmp_path, damage):
    disk = DiskTier(tmp_path, capacity_bytes=1 << 20, fsync=False)
    disk.put(block(7))
    path = disk.path_of(7)
    data = bytearray(path.read_bytes())
    if damage == "flip_payload_byte":
        data[-1] ^= 0xFF
    elif damage == "truncate":
        data = data[:-10]
    else:
        data = bytearray(b"not a block")
    path.write_bytes(bytes(data))
    assert disk.get(7) is None
    assert not path.exists() and not disk.contains(7)
    assert disk.num_corrupt == 1 and disk.used_bytes == 0


def test_disk_evicts_least_recently_used_beyond_capacity(tmp_path):
    one = DiskTier(tmp_path / "probe", capacity_bytes=1 << 20, fsync=False).file_size(block(1))
    disk = DiskTier(tmp_path / "d", capacity_bytes=2 * one + 10, fsync=False)
    disk.put(block(1))
    disk.put(block(2))
    disk.get(1)
    assert disk.put(block(3)) == [2]
    assert disk.contains(1) and disk.contains(3) and not disk.path_of(2).exists()
    assert disk.used_bytes <= disk.capacity_bytes


def test_restart_rebuilds_the_index_and_removes_leftover_temp_files(tmp_path):
    disk = DiskTier(tmp_path, capacity_bytes=1 << 20, fsync=False)
    blocks = [block(h) for h in (10, 11, 12)]
    for b in blocks:
        disk.put(b)
    leftover = disk.path_of(10).parent / ".tmp-crashed"
    leftover.write_bytes(b"partial")
    reopened = DiskTier(tmp_path, capacity_bytes=1 << 20, fsync=False)
    assert len(reopened) == 3 and reopened.used_bytes == disk.used_bytes
    assert all(reopened.get(b.block_hash) == b for b in blocks)
    assert not leftover.exists()


def test_tiered_store_demotes_host_evictions_to_disk_and_promotes_on_hit(tmp_path):
    store = TieredStore(HostTier(2048), DiskTier(tmp_path, 1 << 20, fsync=False),
                        make_tier_policy(TierPolicyName.DEMOTE_ON_EVICT))
    b1, b2, b3 = block(1), block(2), block(3)
    for b in (b1, b2, b3):
        assert store.put(b).stored
    assert store.tier_of(1) is Tier.ARCHIVED and store.tier_of(3) is Tier.SLEEPING
    assert store.put(b3).already_present
    assert store.get(1) == b1
    assert store.tier_of(1) is Tier.SLEEPING  # promoted
    assert store.tier_of(99) is None and store.get(99) is None


def test_host_only_policy_never_writes_disk(tmp_path):
    disk = DiskTier(tmp_path, 1 << 20, fsync=False)
    store = TieredStore(HostTier(1024), disk, make_tier_policy(TierPolicyName.HOST_ONLY))
    store.put(block(1))
    store.put(block(2))
    assert len(disk) == 0 and store.tier_of(1) is None and store.tier_of(2) is Tier.SLEEPING


def test_a_full_disk_is_one_log_line_per_interval_not_one_per_block(tmp_path, monkeypatch):
    """Every write fails on a full disk; the log (maybe on that same disk) gets one line per
    errno per interval with a count of those held back, and every failure is counted."""
    import errno

    from structlog.testing import capture_logs

    now = [0.0]
    disk = DiskTier(tmp_path, 1 << 20, fsync=False)
    store = TieredStore(HostTier(1024), disk, make_tier_policy(TierPolicyName.DEMOTE_ON_EVICT), clock=lambda: now[0])

    def full(_block):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk, "put", full)
    with capture_logs() as logs:
        for h in range(1, 101):  # each put evicts the previous block from RAM toward the full disk
            store.put(block(h))
        now[0] += 11.0
        store.put(block(1000))
    lines = [e for e in logs if e["event"] == "disk_write_failed"]
    assert store.counters.num_disk_write_errors == 100
    assert len(lines) == 2 and all(e["reason"] == "ENOSPC" for e in lines)
    assert lines[1]["num_suppressed"] == 98
