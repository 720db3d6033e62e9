from weft.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ExecuteRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "tenant_salt", "partition", "priority", "session", "pin_ttl_ms", "kv_quota_blocks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TENANT_SALT_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PIN_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    KV_QUOTA_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    tenant_salt: str
    partition: str
    priority: float
    session: _common_pb2.SessionInfo
    pin_ttl_ms: int
    kv_quota_blocks: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., tenant_salt: _Optional[str] = ..., partition: _Optional[str] = ..., priority: _Optional[float] = ..., session: _Optional[_Union[_common_pb2.SessionInfo, _Mapping]] = ..., pin_ttl_ms: _Optional[int] = ..., kv_quota_blocks: _Optional[int] = ...) -> None: ...

class ExecuteResponse(_message.Message):
    __slots__ = ("request_id", "token_ids_delta", "logprobs_delta", "finish_reason", "usage", "executor", "mean_entropy", "top_logprobs_delta", "prompt_logprobs", "prompt_top_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_DELTA_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_DELTA_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_FIELD_NUMBER: _ClassVar[int]
    MEAN_ENTROPY_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_DELTA_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids_delta: _containers.RepeatedScalarFieldContainer[int]
    logprobs_delta: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    executor: str
    mean_entropy: float
    top_logprobs_delta: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., token_ids_delta: _Optional[_Iterable[int]] = ..., logprobs_delta: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., executor: _Optional[str] = ..., mean_entropy: _Optional[float] = ..., top_logprobs_delta: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., prompt_top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("executor", "model_id", "block_size", "num_blocks", "num_free_blocks", "num_running", "num_waiting", "num_steps")
    EXECUTOR_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    executor: str
    model_id: str
    block_size: int
    num_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    num_steps: int
    def __init__(self, executor: _Optional[str] = ..., model_id: _Optional[str] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_steps: _Optional[int] = ...) -> None: ...

class ReleaseSessionRequest(_message.Message):
    __slots__ = ("session_id", "evict_block_hashes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EVICT_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    evict_block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., evict_block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseSessionResponse(_message.Message):
    __slots__ = ("num_unpinned_blocks", "num_evicted_blocks")
    NUM_UNPINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_unpinned_blocks: int
    num_evicted_blocks: int
    def __init__(self, num_unpinned_blocks: _Optional[int] = ..., num_evicted_blocks: _Optional[int] = ...) -> None: ...

class DemoteBlocksRequest(_message.Message):
    __slots__ = ("block_hashes", "token_ids", "tenant_salt", "priority", "expected_pause_ms", "evict_local", "evict_first")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TENANT_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_PAUSE_MS_FIELD_NUMBER: _ClassVar[int]
    EVICT_LOCAL_FIELD_NUMBER: _ClassVar[int]
    EVICT_FIRST_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    tenant_salt: str
    priority: float
    expected_pause_ms: int
    evict_local: bool
    evict_first: bool
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., tenant_salt: _Optional[str] = ..., priority: _Optional[float] = ..., expected_pause_ms: _Optional[int] = ..., evict_local: _Optional[bool] = ..., evict_first: _Optional[bool] = ...) -> None: ...

class DemoteBlocksResponse(_message.Message):
    __slots__ = ("num_demoted_blocks", "num_already_stored_blocks", "num_missing_blocks", "demoted_bytes", "num_evicted_blocks")
    NUM_DEMOTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_ALREADY_STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_MISSING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEMOTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_demoted_blocks: int
    num_already_stored_blocks: int
    num_missing_blocks: int
    demoted_bytes: int
    num_evicted_blocks: int
    def __init__(self, num_demoted_blocks: _Optional[int] = ..., num_already_stored_blocks: _Optional[int] = ..., num_missing_blocks: _Optional[int] = ..., demoted_bytes: _Optional[int] = ..., num_evicted_blocks: _Optional[int] = ...) -> None: ...

class PromoteBlocksRequest(_message.Message):
    __slots__ = ("token_ids", "tenant_salt", "partition", "force")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TENANT_SALT_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    tenant_salt: str
    partition: str
    force: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., tenant_salt: _Optional[str] = ..., partition: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class PromoteBlocksResponse(_message.Message):
    __slots__ = ("num_local_blocks", "num_promoted_blocks", "num_available_blocks", "promoted_bytes", "load_ms", "skipped_by_cost_model")
    NUM_LOCAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMOTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_AVAILABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROMOTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_MS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_BY_COST_MODEL_FIELD_NUMBER: _ClassVar[int]
    num_local_blocks: int
    num_promoted_blocks: int
    num_available_blocks: int
    promoted_bytes: int
    load_ms: float
    skipped_by_cost_model: bool
    def __init__(self, num_local_blocks: _Optional[int] = ..., num_promoted_blocks: _Optional[int] = ..., num_available_blocks: _Optional[int] = ..., promoted_bytes: _Optional[int] = ..., load_ms: _Optional[float] = ..., skipped_by_cost_model: _Optional[bool] = ...) -> None: ...

class UpdatePrioritiesRequest(_message.Message):
    __slots__ = ("request_ids", "priorities")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITIES_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    priorities: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., priorities: _Optional[_Iterable[float]] = ...) -> None: ...

class UpdatePrioritiesResponse(_message.Message):
    __slots__ = ("num_updated",)
    NUM_UPDATED_FIELD_NUMBER: _ClassVar[int]
    num_updated: int
    def __init__(self, num_updated: _Optional[int] = ...) -> None: ...
