"""Requests suspected of killing engines (a poison pill), and how an engine's death is told
apart from a lost process.

NOTE: migration continues a stream whose executor failed on another executor. When the
failure was the ENGINE dying or wedging (not the process being killed), the request
itself may be the cause: a prompt that trips an engine bug then kills every executor it
is moved to, and again on each router resubmission, until the supervisor gives up on
every executor as a crash loop. So a request aboard ``max_engine_failures`` engine
failures is not continued again, and its id is remembered for a while so that a resend
under the same id is refused at once:

    engine of executor-0 dies with r aboard ──▶ r continues on executor-1 (innocents too)
    engine of executor-1 dies with r aboard ──▶ r ends: ABORTED, id remembered
    r resent (router retry)                  ──▶ ABORTED at once, no executor touched
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import grpc

from services.mesh.grpc_server import error_origin_of

# The executor's domain error for a dead or wedged engine (services/executor/engine/async_engine.py;
# every stream it ends then, and every call it refuses, carries it in the weft-error trailer).
ENGINE_FAILURE_ORIGIN = "EngineDeadError"


def is_engine_failure(error: BaseException | None) -> bool:
    """Whether an executor call failed because its ENGINE died or wedged: the executor
    chose that status and named EngineDeadError, as opposed to a transport failure (a killed
    or unreachable process) or another refusal. Looks through ``raise ... from`` chains to
    the gRPC error; never parses the message."""
    while error is not None and not isinstance(error, grpc.aio.AioRpcError):
        error = error.__cause__
    return error is not None and error_origin_of(error) == ENGINE_FAILURE_ORIGIN


class SuspectedPoison(Exception):
    """The request was aboard too many engine failures to be continued again."""


class SuspectRegistry:
    """Request ids recently ended as suspected poison, bounded in count and age."""

    def __init__(self, max_entries: int = 4096, ttl_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.clock = clock
        self._ids: OrderedDict[str, tuple[float, str]] = OrderedDict()  # id -> (when, why)

    def add(self, request_id: str, reason: str) -> None:
        self._ids.pop(request_id, None)
        self._ids[request_id] = (self.clock(), reason)
        while len(self._ids) > self.max_entries:
            self._ids.popitem(last=False)

    def reason(self, request_id: str) -> str | None:
        """Why ``request_id`` is suspected, or None (also once its entry aged out)."""
        entry = self._ids.get(request_id)
        if entry is None:
            return None
        if self.clock() - entry[0] > self.ttl_s:
            del self._ids[request_id]
            return None
        return entry[1]
