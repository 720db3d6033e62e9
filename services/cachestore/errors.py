"""Domain errors of the cachestore; ``ERROR_RULES`` is the interceptor's mapping:
InvalidBlockError / InvalidQueryError → INVALID_ARGUMENT (names the field), StoreFullError →
RESOURCE_EXHAUSTED, anything else → INTERNAL."""
from __future__ import annotations

import grpc

from services.mesh.grpc_server import ErrorRule


class CacheStoreError(Exception):
    """Base class of the cachestore's domain errors."""


class InvalidBlockError(CacheStoreError, ValueError):
    """A malformed or oversized payload; ``field`` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class InvalidQueryError(CacheStoreError, ValueError):
    """A malformed semantic request (too many / too long texts, unknown kind)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class StoreFullError(CacheStoreError):
    """A block fits no tier."""

    def __init__(self, message: str, retry_after_ms: int = 1000) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


ERROR_RULES = (
    ErrorRule(InvalidBlockError, grpc.StatusCode.INVALID_ARGUMENT),
    ErrorRule(InvalidQueryError, grpc.StatusCode.INVALID_ARGUMENT),
    ErrorRule(StoreFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
)
