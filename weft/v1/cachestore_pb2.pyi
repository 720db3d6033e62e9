from weft.v1 import events_pb2 as _events_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BlockHeader(_message.Message):
    __slots__ = ("block_hash", "dtype", "shape", "size_bytes", "checksum", "model_id", "block_size")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    block_hash: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    size_bytes: int
    checksum: int
    model_id: str
    block_size: int
    def __init__(self, block_hash: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., size_bytes: _Optional[int] = ..., checksum: _Optional[int] = ..., model_id: _Optional[str] = ..., block_size: _Optional[int] = ...) -> None: ...

class PutBlocksChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: BlockHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[BlockHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutBlocksResponse(_message.Message):
    __slots__ = ("num_stored", "stored_bytes", "num_already_present")
    NUM_STORED_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    num_stored: int
    stored_bytes: int
    num_already_present: int
    def __init__(self, num_stored: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., num_already_present: _Optional[int] = ...) -> None: ...

class GetBlocksRequest(_message.Message):
    __slots__ = ("block_hashes", "max_chunk_bytes")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    max_chunk_bytes: int
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class GetBlocksChunk(_message.Message):
    __slots__ = ("header", "data", "missing_block_hash")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    MISSING_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    header: BlockHeader
    data: bytes
    missing_block_hash: int
    def __init__(self, header: _Optional[_Union[BlockHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., missing_block_hash: _Optional[int] = ...) -> None: ...

class ContainsRequest(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class ContainsResponse(_message.Message):
    __slots__ = ("tiers",)
    TIERS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedScalarFieldContainer[_events_pb2.Tier]
    def __init__(self, tiers: _Optional[_Iterable[_Union[_events_pb2.Tier, str]]] = ...) -> None: ...

class CacheStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "num_blocks", "used_bytes", "capacity_bytes", "num_hits", "num_misses", "num_evictions")
    TIER_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_MISSES_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    tier: _events_pb2.Tier
    num_blocks: int
    used_bytes: int
    capacity_bytes: int
    num_hits: int
    num_misses: int
    num_evictions: int
    def __init__(self, tier: _Optional[_Union[_events_pb2.Tier, str]] = ..., num_blocks: _Optional[int] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., num_hits: _Optional[int] = ..., num_misses: _Optional[int] = ..., num_evictions: _Optional[int] = ...) -> None: ...

class CacheStatsResponse(_message.Message):
    __slots__ = ("tiers", "num_corrupt_blocks")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    NUM_CORRUPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    num_corrupt_blocks: int
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., num_corrupt_blocks: _Optional[int] = ...) -> None: ...
