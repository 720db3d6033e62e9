from weft.v1 import common_pb2 as _common_pb2
from weft.v1 import events_pb2 as _events_pb2
from weft.v1 import router_pb2 as _router_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScheduleRequest(_message.Message):
    __slots__ = ("request_id", "model_id", "prompt_token_ids", "tenant", "sampling", "session", "deadline_unix_ms", "priority", "fork_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    FORK_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tenant: str
    sampling: _common_pb2.SamplingParams
    session: _common_pb2.SessionInfo
    deadline_unix_ms: int
    priority: float
    fork_id: str
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., tenant: _Optional[str] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., session: _Optional[_Union[_common_pb2.SessionInfo, _Mapping]] = ..., deadline_unix_ms: _Optional[int] = ..., priority: _Optional[float] = ..., fork_id: _Optional[str] = ...) -> None: ...

class ScheduleResponse(_message.Message):
    __slots__ = ("request_id", "token_ids_delta", "logprobs_delta", "finish_reason", "usage", "executor", "queue_ms", "fallback_taken", "fallback_reason", "request_class", "pause_decision", "degradation_rung", "num_migrations", "top_logprobs_delta", "prompt_logprobs", "prompt_top_logprobs", "decisions")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_DELTA_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_DELTA_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_TAKEN_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_REASON_FIELD_NUMBER: _ClassVar[int]
    REQUEST_CLASS_FIELD_NUMBER: _ClassVar[int]
    PAUSE_DECISION_FIELD_NUMBER: _ClassVar[int]
    DEGRADATION_RUNG_FIELD_NUMBER: _ClassVar[int]
    NUM_MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_DELTA_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids_delta: _containers.RepeatedScalarFieldContainer[int]
    logprobs_delta: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    executor: str
    queue_ms: int
    fallback_taken: _common_pb2.FallbackPath
    fallback_reason: str
    request_class: _common_pb2.RequestClass
    pause_decision: _common_pb2.PauseDecision
    degradation_rung: _common_pb2.DegradationRung
    num_migrations: int
    top_logprobs_delta: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    decisions: _common_pb2.SchedulingDecisions
    def __init__(self, request_id: _Optional[str] = ..., token_ids_delta: _Optional[_Iterable[int]] = ..., logprobs_delta: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., executor: _Optional[str] = ..., queue_ms: _Optional[int] = ..., fallback_taken: _Optional[_Union[_common_pb2.FallbackPath, str]] = ..., fallback_reason: _Optional[str] = ..., request_class: _Optional[_Union[_common_pb2.RequestClass, str]] = ..., pause_decision: _Optional[_Union[_common_pb2.PauseDecision, str]] = ..., degradation_rung: _Optional[_Union[_common_pb2.DegradationRung, str]] = ..., num_migrations: _Optional[int] = ..., top_logprobs_delta: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., prompt_top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., decisions: _Optional[_Union[_common_pb2.SchedulingDecisions, _Mapping]] = ...) -> None: ...

class ListExecutorsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerEndSessionRequest(_message.Message):
    __slots__ = ("tenant", "session_id", "fork_id")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FORK_ID_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    session_id: str
    fork_id: str
    def __init__(self, tenant: _Optional[str] = ..., session_id: _Optional[str] = ..., fork_id: _Optional[str] = ...) -> None: ...

class SchedulerEndSessionResponse(_message.Message):
    __slots__ = ("ended_now", "num_executors_released", "num_running_hops")
    ENDED_NOW_FIELD_NUMBER: _ClassVar[int]
    NUM_EXECUTORS_RELEASED_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_HOPS_FIELD_NUMBER: _ClassVar[int]
    ended_now: bool
    num_executors_released: int
    num_running_hops: int
    def __init__(self, ended_now: _Optional[bool] = ..., num_executors_released: _Optional[int] = ..., num_running_hops: _Optional[int] = ...) -> None: ...

class SchedulerForkSessionRequest(_message.Message):
    __slots__ = ("tenant", "fork", "or_new", "program_id", "next_hop", "fork_id")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    FORK_FIELD_NUMBER: _ClassVar[int]
    OR_NEW_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_ID_FIELD_NUMBER: _ClassVar[int]
    NEXT_HOP_FIELD_NUMBER: _ClassVar[int]
    FORK_ID_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    fork: _router_pb2.ForkSessionRequest
    or_new: bool
    program_id: str
    next_hop: int
    fork_id: str
    def __init__(self, tenant: _Optional[str] = ..., fork: _Optional[_Union[_router_pb2.ForkSessionRequest, _Mapping]] = ..., or_new: _Optional[bool] = ..., program_id: _Optional[str] = ..., next_hop: _Optional[int] = ..., fork_id: _Optional[str] = ...) -> None: ...

class SchedulerJoinSessionRequest(_message.Message):
    __slots__ = ("tenant", "join")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    JOIN_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    join: _router_pb2.JoinSessionRequest
    def __init__(self, tenant: _Optional[str] = ..., join: _Optional[_Union[_router_pb2.JoinSessionRequest, _Mapping]] = ...) -> None: ...

class SchedulerForkSessionResponse(_message.Message):
    __slots__ = ("fork", "new_sessions")
    FORK_FIELD_NUMBER: _ClassVar[int]
    NEW_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    fork: _router_pb2.ForkSessionResponse
    new_sessions: bool
    def __init__(self, fork: _Optional[_Union[_router_pb2.ForkSessionResponse, _Mapping]] = ..., new_sessions: _Optional[bool] = ...) -> None: ...

class SchedulerJoinSessionResponse(_message.Message):
    __slots__ = ("join",)
    JOIN_FIELD_NUMBER: _ClassVar[int]
    join: _router_pb2.JoinSessionResponse
    def __init__(self, join: _Optional[_Union[_router_pb2.JoinSessionResponse, _Mapping]] = ...) -> None: ...

class ExecutorInfo(_message.Message):
    __slots__ = ("heartbeat", "load", "num_indexed_blocks", "last_seen_ago_ms")
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    NUM_INDEXED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_AGO_MS_FIELD_NUMBER: _ClassVar[int]
    heartbeat: _events_pb2.ExecutorHeartbeat
    load: _events_pb2.LoadReport
    num_indexed_blocks: int
    last_seen_ago_ms: int
    def __init__(self, heartbeat: _Optional[_Union[_events_pb2.ExecutorHeartbeat, _Mapping]] = ..., load: _Optional[_Union[_events_pb2.LoadReport, _Mapping]] = ..., num_indexed_blocks: _Optional[int] = ..., last_seen_ago_ms: _Optional[int] = ...) -> None: ...

class ListExecutorsResponse(_message.Message):
    __slots__ = ("executors",)
    EXECUTORS_FIELD_NUMBER: _ClassVar[int]
    executors: _containers.RepeatedCompositeFieldContainer[ExecutorInfo]
    def __init__(self, executors: _Optional[_Iterable[_Union[ExecutorInfo, _Mapping]]] = ...) -> None: ...
