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


# Session lifecycle (docs/sessions.md): the router reads the error's class name from the
# interceptor's trailing ``weft-error`` metadata (SessionBusyError -> HTTP 409 session_busy).
class SessionBusyError(SchedulerError):
    """A hop (or a fork / join) arrived while a hop of the session runs: ABORTED, HTTP 409."""

    def __init__(self, session_id: str, running_request_id: str) -> None:
        super().__init__(f"session {session_id!r} already has a running hop (request {running_request_id!r}); "
                         "send the next hop after it ends")
        self.session_id = session_id
        self.running_request_id = running_request_id


class SessionNotFoundError(SchedulerError):
    """The tenant has no such session (another tenant's id reads the same): NOT_FOUND."""

    def __init__(self, session_id: str, why: str = "") -> None:
        super().__init__(f"no session {session_id!r}{why}")
        self.session_id = session_id


class SessionExistsError(SchedulerError):
    """A fork names a child id the tenant already uses: ALREADY_EXISTS, HTTP 409."""

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id!r} already exists: choose another child id or end it first")
        self.session_id = session_id


ERROR_RULES = (
    ErrorRule(SessionBusyError, grpc.StatusCode.ABORTED),
    ErrorRule(SessionNotFoundError, grpc.StatusCode.NOT_FOUND),
    ErrorRule(SessionExistsError, grpc.StatusCode.ALREADY_EXISTS),
    ErrorRule(InvalidScheduleRequest, grpc.StatusCode.INVALID_ARGUMENT),
    ErrorRule(OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    ErrorRule(NoExecutorError, grpc.StatusCode.UNAVAILABLE),
    ErrorRule(ExecutorLostError, grpc.StatusCode.UNAVAILABLE),
    ErrorRule(DeadlineError, grpc.StatusCode.DEADLINE_EXCEEDED),
    ErrorRule(SuspectedPoisonError, grpc.StatusCode.ABORTED),
)
