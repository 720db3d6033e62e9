"""Retry policies for gRPC calls: bounded, jittered, only on retryable codes.

Only UNAVAILABLE (a peer is down or draining) and RESOURCE_EXHAUSTED (overload) are
retried; INVALID_ARGUMENT and the rest never are. A server's ``retry-after-ms`` hint
raises the wait to at least that long (still capped by ``max_wait_s``).

    async for attempt in rpc_retrying():
        with attempt:
            reply = await stub.Contains(request, timeout=1.0)
"""
from __future__ import annotations

from collections.abc import Callable

import grpc
from tenacity import (AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, stop_after_delay,
                      wait_random_exponential)

from services.mesh.grpc_server import retry_after_ms_of

RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})


def is_retryable(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in RETRYABLE_CODES


class _WaitWithHint:
    """Jittered exponential wait, raised to the server's retry-after hint."""

    def __init__(self, initial_s: float, max_wait_s: float) -> None:
        self.jitter = wait_random_exponential(multiplier=initial_s, max=max_wait_s)
        self.max_wait_s = max_wait_s

    def __call__(self, state: RetryCallState) -> float:
        wait_s = self.jitter(state)
        exc = state.outcome.exception() if state.outcome else None
        if isinstance(exc, grpc.aio.AioRpcError):
            hint_ms = retry_after_ms_of(exc)
            if hint_ms is not None:
                wait_s = max(wait_s, hint_ms / 1000.0)
        return min(wait_s, self.max_wait_s)


def rpc_retrying(max_attempts: int = 3, initial_s: float = 0.05, max_wait_s: float = 1.0) -> AsyncRetrying:
    """A tenacity policy for one logical call; reraises the last error when exhausted."""
    if max_attempts < 1:
        raise ValueError("max_attempts must be >= 1")
    return AsyncRetrying(
        stop=stop_after_attempt(max_attempts),
        wait=_WaitWithHint(initial_s, max_wait_s),
        retry=retry_if_exception(is_retryable),
        reraise=True,
    )


def outage_retrying(within_s: float, retry: Callable[[BaseException], bool], initial_s: float = 0.1,
                    max_wait_s: float = 1.0) -> AsyncRetrying:
    """A tenacity policy that rides out a peer's outage: retries while ``retry(exc)``,
    jittered exponential waits capped at ``max_wait_s``, no new try after ``within_s``
    seconds; reraises the last error then."""
    if within_s < 0:
        raise ValueError("within_s must be >= 0")
    return AsyncRetrying(
        stop=stop_after_delay(within_s),
        wait=wait_random_exponential(multiplier=initial_s, max=max_wait_s),
        retry=retry_if_exception(retry),
        reraise=True,
    )
