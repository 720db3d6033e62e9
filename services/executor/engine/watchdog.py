"""Watches the engine thread: a dead or wedged engine must take its executor out of the mesh.

The engine thread (async_engine.py) lets no exception escape its loop, but a thread can
still end (a ``BaseException``, a bug in the last-resort handler) or stop making progress
(a kernel that never returns, a deadlock in a callback). Either way the gRPC server and
the heartbeat would stay green while every request waits forever, so the watchdog turns
such a state into a verdict and hands it to the process wiring (app.py), which reports
NOT_SERVING / FAILED, fails the streams in flight with UNAVAILABLE and exits non-zero so
a supervisor restarts the executor.

Policy apart from mechanism: ``WatchdogPolicy.decide(probe, now_s)`` is pure (tested with
a fake clock); ``EngineWatchdog`` only polls the probe and calls the failure hook once.

    wedged  <=>  not stopping  and  thread alive  and  not idle
                 and  now - last_progress >= stall_s          (stall_s = 0: never)
    dead    <=>  not stopping  and  thread not alive
"""
from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

log = structlog.get_logger(__name__)

POLL_INTERVAL_S = 0.25  # a dead thread is noticed within this; cheap (reads four attributes)


class EngineVerdict(enum.Enum):
    OK = "ok"
    DEAD = "dead"  # the engine thread has ended without a shutdown
    WEDGED = "wedged"  # it holds work but has made no progress for stall_s


@dataclass(frozen=True)
class EngineProbe:
    """What the engine thread last said about itself (read from another thread; each field
    is one attribute read, so a probe is never torn in a way that matters: see decide)."""

    thread_alive: bool
    stopping: bool  # a planned shutdown: the thread ending then is no failure
    idle: bool  # blocked waiting for commands with no unfinished request
    last_progress_s: float  # monotonic time of the last step / command / wake-up


@dataclass(frozen=True)
class WatchdogPolicy:
    stall_s: float  # seconds without progress while busy that count as wedged; 0 disables

    def __post_init__(self) -> None:
        if self.stall_s < 0:
            raise ValueError(f"engine_stall_s must be >= 0, got {self.stall_s}")

    def decide(self, probe: EngineProbe, now_s: float) -> EngineVerdict:
        """Pure: the verdict for one probe at ``now_s`` (same clock as the probe's times).

        The engine thread marks progress *before* it clears ``idle`` on waking, so a probe
        taken just as work arrives after a long idle spell never reads as wedged."""
        if probe.stopping:
            return EngineVerdict.OK
        if not probe.thread_alive:
            return EngineVerdict.DEAD
        if self.stall_s and not probe.idle and now_s - probe.last_progress_s >= self.stall_s:
            return EngineVerdict.WEDGED
        return EngineVerdict.OK


class EngineWatchdog:
    """Polls ``probe`` every ``interval_s``; on the first non-OK verdict awaits
    ``on_failure(verdict, stalled_s)`` once and stops watching."""

    def __init__(
        self,
        probe: Callable[[], EngineProbe],
        policy: WatchdogPolicy,
        on_failure: Callable[[EngineVerdict, float], Awaitable[None]],
        interval_s: float = POLL_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.probe = probe
        self.policy = policy
        self.on_failure = on_failure
        self.interval_s = interval_s
        self.clock = clock
        self.verdict = EngineVerdict.OK
        self._task: asyncio.Task | None = None

    async def check_once(self) -> EngineVerdict:
        """One probe and decision; fires ``on_failure`` on the first failure only."""
        if self.verdict is not EngineVerdict.OK:
            return self.verdict
        probe, now_s = self.probe(), self.clock()
        verdict = self.policy.decide(probe, now_s)
        if verdict is not EngineVerdict.OK:
            self.verdict = verdict
            await self.on_failure(verdict, max(0.0, now_s - probe.last_progress_s))
        return verdict

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch_forever(), name="engine-watchdog")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _watch_forever(self) -> None:
        while self.verdict is EngineVerdict.OK:
            try:
                await self.check_once()
            except Exception:  # the hook failed; the verdict stands and the process wiring's backstop exits
                log.exception("engine_watchdog_hook_failed")
            await asyncio.sleep(self.interval_s)
