"""Readiness: can this router serve a generation right now?

Liveness and readiness are different questions, answered on different paths:

    GET /health         liveness: the process answers (503 only while draining). A
                        restart would not help a router whose executors are missing.
    GET /health/ready   readiness: the scheduler answers ``ListExecutors`` within
                        ``timeout_s`` and reports at least one SERVING executor. Load
                        balancers, Compose healthchecks and ``weft up`` wait on this.
    grpc.health.v1      liveness of the gRPC door (SERVING until SIGTERM drains it).

A load balancer may poll readiness often: one answer is cached for ``ttl_s`` and
concurrent callers share one in-flight probe, so polling costs the scheduler at most one
``ListExecutors`` per ``ttl_s`` whatever the number of pollers.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

log = structlog.get_logger(__name__)

SERVING = "serving"


@dataclass(frozen=True)
class ReadinessReport:
    ready: bool
    num_serving_executors: int
    reason: str = ""  # why not ready

    def to_json(self) -> dict:
        if self.ready:
            return {"status": "ready", "num_serving_executors": self.num_serving_executors}
        return {"status": "not_ready", "reason": self.reason}


class Readiness:
    """Probes the scheduler's executor list; ``list_executors`` returns dicts with a
    ``state`` ("serving", "joining", "draining", "failed", "unspecified")."""

    def __init__(self, list_executors: Callable[[], Awaitable[list[dict]]] | None, timeout_s: float = 1.0,
                 ttl_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._list_executors = list_executors
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self._clock = clock
        self._cached: tuple[float, ReadinessReport] | None = None
        self._probe: asyncio.Task | None = None

    async def check(self) -> ReadinessReport:
        now = self._clock()
        if self._cached is not None and now - self._cached[0] < self.ttl_s:
            return self._cached[1]
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._run_probe())
        # shield: a poller that hangs up must not cancel the probe others wait on
        return await asyncio.shield(self._probe)

    async def _run_probe(self) -> ReadinessReport:
        report = await self._probe_once()
        self._cached = (self._clock(), report)
        if not report.ready:
            log.info("router_not_ready", reason=report.reason)
        return report

    async def _probe_once(self) -> ReadinessReport:
        if self._list_executors is None:
            return ReadinessReport(False, 0, "no scheduler configured")
        try:
            executors = await asyncio.wait_for(self._list_executors(), self.timeout_s)
        except asyncio.TimeoutError:
            return ReadinessReport(False, 0, f"scheduler did not answer within {self.timeout_s:g} s")
        except Exception as exc:  # unreachable, refused, draining: all mean "not ready"
            return ReadinessReport(False, 0, f"scheduler unreachable ({type(exc).__name__})")
        num_serving = sum(1 for e in executors if e.get("state") == SERVING)
        if num_serving == 0:
            return ReadinessReport(False, 0, f"no serving executor ({len(executors)} known)")
        return ReadinessReport(True, num_serving)
