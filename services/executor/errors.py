"""Domain errors of the executor. The gRPC interceptor maps them to status codes:
``InvalidRequestError`` → INVALID_ARGUMENT, ``CapacityError`` → RESOURCE_EXHAUSTED,
everything else → INTERNAL."""
from __future__ import annotations


class ExecutorError(Exception):
    """Base class of the executor's domain errors."""


class ModelLoadError(ExecutorError):
    """A checkpoint directory cannot be loaded (unknown architecture, missing or corrupt
    files, mismatched shapes). The message names the file, tensor or config key."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint's architecture or a config setting is not implemented."""


class CheckpointError(ModelLoadError):
    """Weight files are missing, unreadable, or disagree with ``config.json``."""


class InvalidRequestError(ExecutorError, ValueError):
    """A request is malformed; ``field`` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class CapacityError(ExecutorError):
    """The engine cannot take the request now; retry later."""

    def __init__(self, message: str, retry_after_ms: int = 1000) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms
