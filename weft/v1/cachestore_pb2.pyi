from weft.v1 import events_pb2 as _events_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SemanticKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SEMANTIC_KIND_UNSPECIFIED: _ClassVar[SemanticKind]
    SEMANTIC_KIND_RESPONSE: _ClassVar[SemanticKind]
    SEMANTIC_KIND_SESSION_PREFIX: _ClassVar[SemanticKind]
SEMANTIC_KIND_UNSPECIFIED: SemanticKind
SEMANTIC_KIND_RESPONSE: SemanticKind
SEMANTIC_KIND_SESSION_PREFIX: SemanticKind

class BlockHeader(_message.Message):
    __slots__ = ("block_hash", "dtype", "shape", "size_bytes", "checksum", "model_id", "block_size", "priority", "expected_pause_ms")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_PAUSE_MS_FIELD_NUMBER: _ClassVar[int]
    block_hash: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    size_bytes: int
    checksum: int
    model_id: str
    block_size: int
    priority: float
    expected_pause_ms: int
    def __init__(self, block_hash: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., size_bytes: _Optional[int] = ..., checksum: _Optional[int] = ..., model_id: _Optional[str] = ..., block_size: _Optional[int] = ..., priority: _Optional[float] = ..., expected_pause_ms: _Optional[int] = ...) -> None: ...

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

class EmbedRequest(_message.Message):
    __slots__ = ("texts",)
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, texts: _Optional[_Iterable[str]] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embeddings", "dim", "num_tokens", "model")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    dim: int
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    model: str
    def __init__(self, embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., dim: _Optional[int] = ..., num_tokens: _Optional[_Iterable[int]] = ..., model: _Optional[str] = ...) -> None: ...

class SimilarityRequest(_message.Message):
    __slots__ = ("text_a", "text_b")
    TEXT_A_FIELD_NUMBER: _ClassVar[int]
    TEXT_B_FIELD_NUMBER: _ClassVar[int]
    text_a: str
    text_b: str
    def __init__(self, text_a: _Optional[str] = ..., text_b: _Optional[str] = ...) -> None: ...

class SimilarityResponse(_message.Message):
    __slots__ = ("similarity", "similar", "threshold")
    SIMILARITY_FIELD_NUMBER: _ClassVar[int]
    SIMILAR_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    similarity: float
    similar: bool
    threshold: float
    def __init__(self, similarity: _Optional[float] = ..., similar: _Optional[bool] = ..., threshold: _Optional[float] = ...) -> None: ...

class SemanticLookupRequest(_message.Message):
    __slots__ = ("tenant", "kind", "text", "scope")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    kind: SemanticKind
    text: str
    scope: str
    def __init__(self, tenant: _Optional[str] = ..., kind: _Optional[_Union[SemanticKind, str]] = ..., text: _Optional[str] = ..., scope: _Optional[str] = ...) -> None: ...

class SemanticLookupResponse(_message.Message):
    __slots__ = ("hit", "similarity", "token_ids", "threshold")
    HIT_FIELD_NUMBER: _ClassVar[int]
    SIMILARITY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    hit: bool
    similarity: float
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    threshold: float
    def __init__(self, hit: _Optional[bool] = ..., similarity: _Optional[float] = ..., token_ids: _Optional[_Iterable[int]] = ..., threshold: _Optional[float] = ...) -> None: ...

class SemanticStoreRequest(_message.Message):
    __slots__ = ("tenant", "kind", "text", "scope", "token_ids")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    kind: SemanticKind
    text: str
    scope: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tenant: _Optional[str] = ..., kind: _Optional[_Union[SemanticKind, str]] = ..., text: _Optional[str] = ..., scope: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SemanticStoreResponse(_message.Message):
    __slots__ = ("stored", "num_entries")
    STORED_FIELD_NUMBER: _ClassVar[int]
    NUM_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    stored: bool
    num_entries: int
    def __init__(self, stored: _Optional[bool] = ..., num_entries: _Optional[int] = ...) -> None: ...

class PrefetchBlocksRequest(_message.Message):
    __slots__ = ("tenant", "token_ids")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tenant: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefetchBlocksResponse(_message.Message):
    __slots__ = ("num_found_blocks", "num_warmed_blocks")
    NUM_FOUND_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_WARMED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_found_blocks: int
    num_warmed_blocks: int
    def __init__(self, num_found_blocks: _Optional[int] = ..., num_warmed_blocks: _Optional[int] = ...) -> None: ...

class ArchiveBlocksRequest(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class ArchiveBlocksResponse(_message.Message):
    __slots__ = ("num_archived_blocks", "num_already_archived_blocks", "num_missing_blocks", "num_kept_blocks")
    NUM_ARCHIVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_ALREADY_ARCHIVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_MISSING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_KEPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_archived_blocks: int
    num_already_archived_blocks: int
    num_missing_blocks: int
    num_kept_blocks: int
    def __init__(self, num_archived_blocks: _Optional[int] = ..., num_already_archived_blocks: _Optional[int] = ..., num_missing_blocks: _Optional[int] = ..., num_kept_blocks: _Optional[int] = ...) -> None: ...
