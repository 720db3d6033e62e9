from weft.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_ACTIVE: _ClassVar[Tier]
    TIER_SLEEPING: _ClassVar[Tier]
    TIER_ARCHIVED: _ClassVar[Tier]

class KvEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_EVENT_KIND_UNSPECIFIED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_STORED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_REMOVED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_CLEARED: _ClassVar[KvEventKind]

class ExecutorState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EXECUTOR_STATE_UNSPECIFIED: _ClassVar[ExecutorState]
    EXECUTOR_STATE_JOINING: _ClassVar[ExecutorState]
    EXECUTOR_STATE_SERVING: _ClassVar[ExecutorState]
    EXECUTOR_STATE_DRAINING: _ClassVar[ExecutorState]
    EXECUTOR_STATE_FAILED: _ClassVar[ExecutorState]
TIER_UNSPECIFIED: Tier
TIER_ACTIVE: Tier
TIER_SLEEPING: Tier
TIER_ARCHIVED: Tier
KV_EVENT_KIND_UNSPECIFIED: KvEventKind
KV_EVENT_KIND_STORED: KvEventKind
KV_EVENT_KIND_REMOVED: KvEventKind
KV_EVENT_KIND_CLEARED: KvEventKind
EXECUTOR_STATE_UNSPECIFIED: ExecutorState
EXECUTOR_STATE_JOINING: ExecutorState
EXECUTOR_STATE_SERVING: ExecutorState
EXECUTOR_STATE_DRAINING: ExecutorState
EXECUTOR_STATE_FAILED: ExecutorState

class EventHeader(_message.Message):
    __slots__ = ("event_id", "source", "sequence", "timestamp_ms", "epoch")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    source: str
    sequence: int
    timestamp_ms: int
    epoch: str
    def __init__(self, event_id: _Optional[str] = ..., source: _Optional[str] = ..., sequence: _Optional[int] = ..., timestamp_ms: _Optional[int] = ..., epoch: _Optional[str] = ...) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("header", "kind", "block_hashes", "parent_hash", "tier", "model_id", "block_size", "partition")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    header: EventHeader
    kind: KvEventKind
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    parent_hash: int
    tier: Tier
    model_id: str
    block_size: int
    partition: str
    def __init__(self, header: _Optional[_Union[EventHeader, _Mapping]] = ..., kind: _Optional[_Union[KvEventKind, str]] = ..., block_hashes: _Optional[_Iterable[int]] = ..., parent_hash: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ..., model_id: _Optional[str] = ..., block_size: _Optional[int] = ..., partition: _Optional[str] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("header", "num_running", "num_waiting", "num_free_blocks", "num_blocks", "prefill_tokens_per_s", "num_prefills", "transfer_bytes_per_s", "num_transfers", "block_bytes", "transfer_overhead_ms")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_OVERHEAD_MS_FIELD_NUMBER: _ClassVar[int]
    header: EventHeader
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    prefill_tokens_per_s: float
    num_prefills: int
    transfer_bytes_per_s: float
    num_transfers: int
    block_bytes: int
    transfer_overhead_ms: float
    def __init__(self, header: _Optional[_Union[EventHeader, _Mapping]] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_blocks: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., num_prefills: _Optional[int] = ..., transfer_bytes_per_s: _Optional[float] = ..., num_transfers: _Optional[int] = ..., block_bytes: _Optional[int] = ..., transfer_overhead_ms: _Optional[float] = ...) -> None: ...

class ExecutorHeartbeat(_message.Message):
    __slots__ = ("header", "name", "address", "model_id", "block_size", "state", "max_num_seqs", "num_blocks", "interval_ms", "max_model_len", "serves_rung", "kv_cache_dtype", "signature")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    SERVES_RUNG_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    header: EventHeader
    name: str
    address: str
    model_id: str
    block_size: int
    state: ExecutorState
    max_num_seqs: int
    num_blocks: int
    interval_ms: int
    max_model_len: int
    serves_rung: _common_pb2.DegradationRung
    kv_cache_dtype: str
    signature: bytes
    def __init__(self, header: _Optional[_Union[EventHeader, _Mapping]] = ..., name: _Optional[str] = ..., address: _Optional[str] = ..., model_id: _Optional[str] = ..., block_size: _Optional[int] = ..., state: _Optional[_Union[ExecutorState, str]] = ..., max_num_seqs: _Optional[int] = ..., num_blocks: _Optional[int] = ..., interval_ms: _Optional[int] = ..., max_model_len: _Optional[int] = ..., serves_rung: _Optional[_Union[_common_pb2.DegradationRung, str]] = ..., kv_cache_dtype: _Optional[str] = ..., signature: _Optional[bytes] = ...) -> None: ...
