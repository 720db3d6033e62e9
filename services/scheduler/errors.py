"""Domain errors of the scheduler; ``ERROR_RULES`` is the interceptor's mapping:

    InvalidScheduleRequest → INVALID_ARGUMENT   (never retried)
    OverloadedError        → RESOURCE_EXHAUSTED (retry-after-ms trailing metadata)
    NoExecutorError        → UNAVAILABLE        (retry-after-ms trailing metadata)
    ExecutorLostError      → UNAVAILABLE
    DeadlineError          → DEADLINE_EXCEEDED
    anything else          → INTERNAL
"""
from __future__ import annotations

import grpc

from services.mesh.grpc_server import ErrorRule


class SchedulerError(Exception):
    """Base class of the scheduler's domain errors."""


class InvalidScheduleRequest(SchedulerError, ValueError):
    """A request is malformed; ``field`` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class OverloadedError(SchedulerError):
    """Admission is full: too many requests in flight and queued."""

    def __init__(self, message: str, retry_after_ms: int) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class NoExecutorError(SchedulerError):
    """No serving executor (for the requested model) is known right now."""

    def __init__(self, message: str, retry_after_ms: int = 1000) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class ExecutorLostError(SchedulerError):
    """The executor serving a stream failed after tokens were sent."""


class SuspectedPoisonError(SchedulerError):
    """The request rode too many engine deaths: it may cause them, so it is not retried
    (ABORTED, which no router retries; see suspects.py)."""


class DeadlineError(SchedulerError):
    """The request's deadline passed before it could be placed."""


ERROR_RULES = (
    ErrorRule(InvalidScheduleRequest, grpc.StatusCode.INVALID_ARGUMENT),
    ErrorRule(OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    ErrorRule(NoExecutorError, grpc.StatusCode.UNAVAILABLE),
    ErrorRule(ExecutorLostError, grpc.StatusCode.UNAVAILABLE),
    ErrorRule(DeadlineError, grpc.StatusCode.DEADLINE_EXCEEDED),
    ErrorRule(SuspectedPoisonError, grpc.StatusCode.ABORTED),
)
