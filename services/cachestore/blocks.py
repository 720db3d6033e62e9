"""A KV block payload and its header, as the tiers store it."""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

# Bytes per element of the dtypes a KV block may carry.
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


def checksum(payload: bytes | bytearray | memoryview) -> int:
    """8-byte blake2b digest of the payload, read as a little-endian uint64."""
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")


@dataclass(frozen=True)
class BlockMeta:
    """Everything about a block except its bytes."""

    block_hash: int
    dtype: str
    shape: tuple[int, ...]
    size_bytes: int
    checksum: int
    model_id: str = ""
    block_size: int = 0
    priority: float = 0.0  # program priority hint for the demotion policy
    expected_pause_ms: int = 0  # expected pause before the block is needed again; 0 = unknown

    @property
    def expected_size_bytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Block:
    meta: BlockMeta
    payload: bytes

    @property
    def block_hash(self) -> int:
        return self.meta.block_hash

    @property
    def size_bytes(self) -> int:
        return len(self.payload)
