from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
    FINISH_REASON_TOOL_CALLS: _ClassVar[FinishReason]
    FINISH_REASON_KV_QUOTA: _ClassVar[FinishReason]

class RequestClass(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REQUEST_CLASS_UNSPECIFIED: _ClassVar[RequestClass]
    REQUEST_CLASS_INTERACTIVE: _ClassVar[RequestClass]
    REQUEST_CLASS_DETERMINISTIC: _ClassVar[RequestClass]
    REQUEST_CLASS_BATCH: _ClassVar[RequestClass]
    REQUEST_CLASS_AGENTIC: _ClassVar[RequestClass]

class PauseDecision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAUSE_DECISION_UNSPECIFIED: _ClassVar[PauseDecision]
    PAUSE_DECISION_KEEP: _ClassVar[PauseDecision]
    PAUSE_DECISION_DEMOTE: _ClassVar[PauseDecision]
    PAUSE_DECISION_DROP: _ClassVar[PauseDecision]

class DegradeStep(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DEGRADE_STEP_UNSPECIFIED: _ClassVar[DegradeStep]
    DEGRADE_STEP_KV_INT8: _ClassVar[DegradeStep]
    DEGRADE_STEP_KV_COMPRESS: _ClassVar[DegradeStep]
    DEGRADE_STEP_SMALLER_MODEL: _ClassVar[DegradeStep]
    DEGRADE_STEP_SHED: _ClassVar[DegradeStep]
    DEGRADE_STEP_NONE: _ClassVar[DegradeStep]

class FallbackPath(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FALLBACK_PATH_UNSPECIFIED: _ClassVar[FallbackPath]
    FALLBACK_PATH_DEGRADE: _ClassVar[FallbackPath]
    FALLBACK_PATH_REROUTE: _ClassVar[FallbackPath]
    FALLBACK_PATH_FAIL_FAST: _ClassVar[FallbackPath]

class DegradationRung(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DEGRADATION_RUNG_UNSPECIFIED: _ClassVar[DegradationRung]
    DEGRADATION_RUNG_NONE: _ClassVar[DegradationRung]
    DEGRADATION_RUNG_KV_INT8: _ClassVar[DegradationRung]
    DEGRADATION_RUNG_KV_COMPRESS: _ClassVar[DegradationRung]
    DEGRADATION_RUNG_SMALLER_MODEL: _ClassVar[DegradationRung]
    DEGRADATION_RUNG_SHED: _ClassVar[DegradationRung]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
FINISH_REASON_TOOL_CALLS: FinishReason
FINISH_REASON_KV_QUOTA: FinishReason
REQUEST_CLASS_UNSPECIFIED: RequestClass
REQUEST_CLASS_INTERACTIVE: RequestClass
REQUEST_CLASS_DETERMINISTIC: RequestClass
REQUEST_CLASS_BATCH: RequestClass
REQUEST_CLASS_AGENTIC: RequestClass
PAUSE_DECISION_UNSPECIFIED: PauseDecision
PAUSE_DECISION_KEEP: PauseDecision
PAUSE_DECISION_DEMOTE: PauseDecision
PAUSE_DECISION_DROP: PauseDecision
DEGRADE_STEP_UNSPECIFIED: DegradeStep
DEGRADE_STEP_KV_INT8: DegradeStep
DEGRADE_STEP_KV_COMPRESS: DegradeStep
DEGRADE_STEP_SMALLER_MODEL: DegradeStep
DEGRADE_STEP_SHED: DegradeStep
DEGRADE_STEP_NONE: DegradeStep
FALLBACK_PATH_UNSPECIFIED: FallbackPath
FALLBACK_PATH_DEGRADE: FallbackPath
FALLBACK_PATH_REROUTE: FallbackPath
FALLBACK_PATH_FAIL_FAST: FallbackPath
DEGRADATION_RUNG_UNSPECIFIED: DegradationRung
DEGRADATION_RUNG_NONE: DegradationRung
DEGRADATION_RUNG_KV_INT8: DegradationRung
DEGRADATION_RUNG_KV_COMPRESS: DegradationRung
DEGRADATION_RUNG_SMALLER_MODEL: DegradationRung
DEGRADATION_RUNG_SHED: DegradationRung

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids", "ignore_eos", "logprobs", "min_tokens", "grammar", "top_logprobs", "prompt_logprobs", "logit_bias", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "resumed_output_tokens", "n")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    RESUMED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: bool
    min_tokens: int
    grammar: Grammar
    top_logprobs: int
    prompt_logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    resumed_output_tokens: int
    n: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., resumed_output_tokens: _Optional[int] = ..., n: _Optional[int] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "ebnf", "structural_tag")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    EBNF_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    ebnf: str
    structural_tag: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., ebnf: _Optional[str] = ..., structural_tag: _Optional[str] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Contract(_message.Message):
    __slots__ = ("kv_quota_blocks", "ttft_ceiling_ms", "tpot_ceiling_ms", "fallback", "accepted_degrade_steps")
    KV_QUOTA_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TTFT_CEILING_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_CEILING_MS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DEGRADE_STEPS_FIELD_NUMBER: _ClassVar[int]
    kv_quota_blocks: int
    ttft_ceiling_ms: int
    tpot_ceiling_ms: int
    fallback: FallbackPath
    accepted_degrade_steps: _containers.RepeatedScalarFieldContainer[DegradeStep]
    def __init__(self, kv_quota_blocks: _Optional[int] = ..., ttft_ceiling_ms: _Optional[int] = ..., tpot_ceiling_ms: _Optional[int] = ..., fallback: _Optional[_Union[FallbackPath, str]] = ..., accepted_degrade_steps: _Optional[_Iterable[_Union[DegradeStep, str]]] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "program_id", "hop_index", "expected_tool_ms", "request_class", "contract", "stateful")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_ID_FIELD_NUMBER: _ClassVar[int]
    HOP_INDEX_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_TOOL_MS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_CLASS_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_FIELD_NUMBER: _ClassVar[int]
    STATEFUL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    program_id: str
    hop_index: int
    expected_tool_ms: int
    request_class: RequestClass
    contract: Contract
    stateful: bool
    def __init__(self, session_id: _Optional[str] = ..., program_id: _Optional[str] = ..., hop_index: _Optional[int] = ..., expected_tool_ms: _Optional[int] = ..., request_class: _Optional[_Union[RequestClass, str]] = ..., contract: _Optional[_Union[Contract, _Mapping]] = ..., stateful: _Optional[bool] = ...) -> None: ...

class SchedulingDecisions(_message.Message):
    __slots__ = ("request_class", "priority", "queue_ms", "fallback_taken", "fallback_reason", "degradation_rung", "intent_shift", "intent_distance", "ttft_estimate_ms", "ttft_ceiling_ms", "ttft_achieved_ms", "pause_decision", "expected_cached_tokens")
    REQUEST_CLASS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_TAKEN_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_REASON_FIELD_NUMBER: _ClassVar[int]
    DEGRADATION_RUNG_FIELD_NUMBER: _ClassVar[int]
    INTENT_SHIFT_FIELD_NUMBER: _ClassVar[int]
    INTENT_DISTANCE_FIELD_NUMBER: _ClassVar[int]
    TTFT_ESTIMATE_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_CEILING_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_ACHIEVED_MS_FIELD_NUMBER: _ClassVar[int]
    PAUSE_DECISION_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_class: RequestClass
    priority: float
    queue_ms: int
    fallback_taken: FallbackPath
    fallback_reason: str
    degradation_rung: DegradationRung
    intent_shift: bool
    intent_distance: float
    ttft_estimate_ms: int
    ttft_ceiling_ms: int
    ttft_achieved_ms: int
    pause_decision: PauseDecision
    expected_cached_tokens: int
    def __init__(self, request_class: _Optional[_Union[RequestClass, str]] = ..., priority: _Optional[float] = ..., queue_ms: _Optional[int] = ..., fallback_taken: _Optional[_Union[FallbackPath, str]] = ..., fallback_reason: _Optional[str] = ..., degradation_rung: _Optional[_Union[DegradationRung, str]] = ..., intent_shift: _Optional[bool] = ..., intent_distance: _Optional[float] = ..., ttft_estimate_ms: _Optional[int] = ..., ttft_ceiling_ms: _Optional[int] = ..., ttft_achieved_ms: _Optional[int] = ..., pause_decision: _Optional[_Union[PauseDecision, str]] = ..., expected_cached_tokens: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("num_prompt_tokens", "num_cached_tokens", "num_output_tokens")
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    def __init__(self, num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., num_output_tokens: _Optional[int] = ...) -> None: ...
