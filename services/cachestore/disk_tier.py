"""The archived tier: one file per block in a directory, bounded by bytes, LRU evicted.

File layout (little-endian)::

    +-------+-----------+------------------+-----------------+
    | magic | meta_len  | meta (JSON)      | payload         |
    | 8 B   | u32       | meta_len bytes   | size_bytes      |
    +-------+-----------+------------------+-----------------+

Writes go to a temp file in the same directory, are flushed (fsync optional) and then
renamed over the final name, so a reader sees a whole block or none. Reads verify the
header's every field and type (``disk_header.py``), the payload's length and checksum: a
corrupt or truncated block, or one whose header is wrong in any way, is a miss and its
file is deleted (counted in ``num_corrupt``, logged ``disk_block_corrupt``). On start the index is rebuilt from the directory (oldest mtime = least recent),
reading headers only; leftover temp files are removed.
"""
from __future__ import annotations

import json
import os
import struct
import tempfile
from collections import OrderedDict
from pathlib import Path

import structlog

from services.cachestore.blocks import Block, checksum
from services.cachestore.disk_header import CorruptBlockError, meta_from_record

log = structlog.get_logger(__name__)

MAGIC = b"WEFTKV01"
_PREFIX = struct.Struct("<8sI")
_SUFFIX = ".blk"
_TMP_PREFIX = ".tmp-"


class DiskTier:
    def __init__(self, root: str | Path, capacity_bytes: int, fsync: bool = True) -> None:
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.used_bytes = 0
        self._index: OrderedDict[int, int] = OrderedDict()  # hash -> file size, LRU first
        self.num_hits = 0
        self.num_misses = 0
        self.num_evictions = 0
        self.num_corrupt = 0
        self.root.mkdir(parents=True, exist_ok=True)
        self._rebuild_index()

    def path_of(self, block_hash: int) -> Path:
        name = f"{block_hash:016x}"
        return self.root / name[:2] / (name + _SUFFIX)

    def _rebuild_index(self) -> None:
        entries = []
        for path in self.root.glob("*/*"):
            if path.name.startswith(_TMP_PREFIX):
                path.unlink(missing_ok=True)
                continue
            if path.suffix != _SUFFIX:
                continue
            try:
                block_hash = int(path.stem, 16)
                st = path.stat()
            except (ValueError, OSError):
                continue
            entries.append((st.st_mtime_ns, block_hash, st.st_size))
        for _, block_hash, size in sorted(entries):
            self._index[block_hash] = size
            self.used_bytes += size
        if entries:
            log.info("disk_tier_loaded", root=str(self.root), num_blocks=len(entries), used_bytes=self.used_bytes)
        self._evict_to(self.capacity_bytes)

    @staticmethod
    def _encode(block: Block) -> bytes:
        m = block.meta
        meta = json.dumps({
            "block_hash": m.block_hash, "dtype": m.dtype, "shape": list(m.shape), "size_bytes": m.size_bytes,
            "checksum": m.checksum, "model_id": m.model_id, "block_size": m.block_size,
            "priority": m.priority, "expected_pause_ms": m.expected_pause_ms,
        }).encode()
        return _PREFIX.pack(MAGIC, len(meta)) + meta

    def file_size(self, block: Block) -> int:
        return len(self._encode(block)) + block.size_bytes

    def put(self, block: Block) -> list[int] | None:
        """Write ``block`` atomically, evicting LRU files to make room; returns the
        evicted hashes, or None when it can never fit."""
        header = self._encode(block)
        size = len(header) + block.size_bytes
        if size > self.capacity_bytes:
            return None
        self.remove(block.block_hash)
        evicted = self._evict_to(self.capacity_bytes - size)
        path = self.path_of(block.block_hash)
        path.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(block.payload)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._index[block.block_hash] = size
        self.used_bytes += size
        return evicted

    def get(self, block_hash: int) -> Block | None:
        """The block if present and intact (marked most recently used); a corrupt one is
        deleted and reported as a miss."""
        if block_hash not in self._index:
            self.num_misses += 1
            return None
        path = self.path_of(block_hash)
        try:
            data = path.read_bytes()
            block = self._decode(block_hash, data)
        except (OSError, CorruptBlockError) as exc:
            self.num_corrupt += 1
            self.num_misses += 1
            log.warning("disk_block_corrupt", block_hash=block_hash, error=str(exc))
            self.remove(block_hash)
            return None
        self._index.move_to_end(block_hash)
        self.num_hits += 1
        return block

    @staticmethod
    def _decode(block_hash: int, data: bytes) -> Block:
        if len(data) < _PREFIX.size:
            raise CorruptBlockError("truncated header")
        magic, meta_len = _PREFIX.unpack_from(data)
        if magic != MAGIC:
            raise CorruptBlockError("bad magic")
        start = _PREFIX.size + meta_len
        if start > len(data):
            raise CorruptBlockError(f"header says {meta_len} header bytes, the file is {len(data)} bytes")
        try:
            raw = json.loads(data[_PREFIX.size:start])
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            raise CorruptBlockError(f"header is not JSON: {exc}") from None
        meta = meta_from_record(raw)
        payload = data[start:]
        if meta.block_hash != block_hash:
            raise CorruptBlockError("block hash mismatch")
        if len(payload) != meta.size_bytes:
            raise CorruptBlockError(f"payload is {len(payload)} bytes, header says {meta.size_bytes}")
        if checksum(payload) != meta.checksum:
            raise CorruptBlockError("checksum mismatch")
        return Block(meta, payload)

    def contains(self, block_hash: int) -> bool:
        """Does not touch recency, counters or the file."""
        return block_hash in self._index

    def remove(self, block_hash: int) -> bool:
        size = self._index.pop(block_hash, None)
        if size is None:
            return False
        self.used_bytes -= size
        self.path_of(block_hash).unlink(missing_ok=True)
        return True

    def _evict_to(self, budget_bytes: int) -> list[int]:
        evicted = []
        while self._index and self.used_bytes > budget_bytes:
            block_hash = next(iter(self._index))
            self.remove(block_hash)
            self.num_evictions += 1
            evicted.append(block_hash)
        return evicted

    def hashes(self) -> list[int]:
        """Every indexed hash, least recently used first. Reads no file."""
        return list(self._index)

    def __len__(self) -> int:
        return len(self._index)
