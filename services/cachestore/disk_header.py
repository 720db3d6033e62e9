"""The archived tier's block header, read back from disk and trusted in nothing.

A header on disk is JSON that this process wrote, but the file may since have been
damaged, hand-edited or written by an older build; JSON's types are not the header's
types (``"shape": 7``, ``"size_bytes": "12"``, ``"dtype": 3``). A header that does not
decode to exactly what ``DiskTier.put`` writes is corrupt: ``meta_from_record`` raises
``CorruptBlockError`` naming the field, and the tier turns that into a miss and deletes
the file, the same as a bad checksum. Nothing else may escape: one bad file must never
fail a whole GetBlocks batch.

The bounds are the wire header's (``weft.v1.BlockHeader``: uint64 hash, size and
checksum; uint32 shape dimensions, block size and pause), so a block read from disk can
always be sent back out, and the size must agree with shape × dtype, as PutBlocks
requires on the way in.
"""
from __future__ import annotations

import math

from services.cachestore.blocks import DTYPE_BYTES, BlockMeta

_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1


class CorruptBlockError(ValueError):
    """A block file that cannot be trusted (bad header, length or checksum): a miss."""


def _int(raw: dict, name: str, upper: int, default: int | None = None, lower: int = 0) -> int:
    value = raw.get(name, default)
    # bool is an int subclass in Python; JSON true is not a number here.
    if type(value) is not int or not lower <= value <= upper:
        raise CorruptBlockError(f"header.{name}: expected an integer in [{lower}, {upper}], got {value!r}")
    return value


def meta_from_record(raw: object) -> BlockMeta:
    """The ``BlockMeta`` of a decoded header record; raises ``CorruptBlockError`` on any
    missing field, wrong JSON type, out-of-range value or inconsistent size."""
    if not isinstance(raw, dict):
        raise CorruptBlockError(f"header: expected a JSON object, got {type(raw).__name__}")
    dtype = raw.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise CorruptBlockError(f"header.dtype: expected one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    shape = raw.get("shape")
    if (not isinstance(shape, list) or not shape
            or any(type(d) is not int or not 0 < d <= _U32 for d in shape)):
        raise CorruptBlockError(f"header.shape: expected a non-empty list of positive integers, got {shape!r}")
    size_bytes = _int(raw, "size_bytes", _U64, lower=1)
    if math.prod(shape) * DTYPE_BYTES[dtype] != size_bytes:
        raise CorruptBlockError(f"header.size_bytes: {size_bytes} disagrees with shape {shape} of {dtype}")
    model_id = raw.get("model_id", "")
    if not isinstance(model_id, str):
        raise CorruptBlockError(f"header.model_id: expected a string, got {model_id!r}")
    priority = raw.get("priority", 0.0)
    if type(priority) not in (int, float) or not math.isfinite(priority):
        raise CorruptBlockError(f"header.priority: expected a finite number, got {priority!r}")
    return BlockMeta(
        block_hash=_int(raw, "block_hash", _U64), dtype=dtype, shape=tuple(shape), size_bytes=size_bytes,
        checksum=_int(raw, "checksum", _U64), model_id=model_id, block_size=_int(raw, "block_size", _U32, 0),
        priority=float(priority), expected_pause_ms=_int(raw, "expected_pause_ms", _U32, 0))
