"""A log event that a flood cannot turn into a flood of log lines.

Logs an event at most once per ``interval_s`` per reason, with how many it held back since
the last line (``num_suppressed``). Used where an outsider or a failing disk decides how
often something happens: forged heartbeats (scheduler), a full disk under every block
write (cachestore). Bounded: one slot per reason, and reasons are a small fixed set
(error kinds, not ids).
"""
from __future__ import annotations

import time
from collections.abc import Callable

import structlog


class RateLimitedLog:
    def __init__(self, event: str, interval_s: float, clock: Callable[[], float] = time.monotonic,
                 logger=None, level: str = "warning") -> None:
        self.event = event
        self.interval_s = interval_s
        self.clock = clock
        self._emit = getattr(logger or structlog.get_logger(__name__), level)
        self._last: dict[str, tuple[float, int]] = {}  # reason -> (last logged at, held back since)

    def __call__(self, reason: str, **fields) -> bool:
        """Log (True) or count as held back (False)."""
        now = self.clock()
        last = self._last.get(reason)
        if last is not None and now - last[0] < self.interval_s:
            self._last[reason] = (last[0], last[1] + 1)
            return False
        self._emit(self.event, reason=reason, num_suppressed=last[1] if last else 0, **fields)
        self._last[reason] = (now, 0)
        return True
