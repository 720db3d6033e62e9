"""The restart policy of ``weft up``: when a service process dies unplanned, whether and
when to start it again. Pure (a clock is passed in), so the policy is tested without
processes; ``weft/launcher/supervision.py`` is the mechanism that watches, waits and respawns.

NOTE: a death is answered by a restart after an exponential backoff with jitter,

    delay = min(max_delay_s, base_delay_s * 2 ** (n - 1)) * uniform(1 - jitter, 1)

where n counts this instance's deaths within the last ``window_s`` seconds, so a service
that ran quietly for a window starts again from ``base_delay_s``. The ``max_deaths``-th
death within one window is a crash loop: restarting stops for THAT instance (the rest of
the mesh keeps running) and it stays down until an operator acts (``weft chaos restart``
or ``weft scale``). A planned stop (``weft scale`` down, ``weft chaos kill``, shutdown) is
never reported to the policy.
"""
from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from enum import Enum


class Status(str, Enum):
    """What ``weft ps`` shows for an instance's supervision."""

    RUNNING = "running"
    RESTARTING = "restarting"  # died; waiting out its backoff or starting again
    CRASH_LOOP = "crash-loop"  # too many deaths in a window: no longer restarted
    STOPPED = "stopped"  # stopped on purpose (weft chaos kill): not restarted
    CONFIG_ERROR = "config-error"  # exited EXIT_CONFIG (78): a restart cannot help; not restarted


@dataclass(frozen=True)
class RestartConfig:
    """How hard the launcher tries; validated here so a bad flag names itself."""

    base_delay_s: float = 0.25
    max_delay_s: float = 10.0
    jitter: float = 0.2  # the delay is drawn from [1 - jitter, 1] x the exponential step
    max_deaths: int = 5  # this many deaths within window_s is a crash loop
    window_s: float = 60.0

    def __post_init__(self) -> None:
        if self.base_delay_s < 0 or self.max_delay_s < self.base_delay_s:
            raise ValueError("restart delays need 0 <= base_delay_s <= max_delay_s")
        if not 0 <= self.jitter < 1:
            raise ValueError("restart jitter must be in [0, 1)")
        if self.max_deaths < 1:
            raise ValueError("crash-loop max_deaths must be >= 1")
        if self.window_s <= 0:
            raise ValueError("crash-loop window_s must be > 0")


@dataclass(frozen=True)
class Decision:
    """The answer to one death: restart after ``delay_s``, or give up (a crash loop)."""

    restart: bool
    delay_s: float
    num_recent_deaths: int  # deaths within the window, this one included


class RestartPolicy:
    """One instance's death history. ``on_death`` mutates it; nothing else does."""

    def __init__(self, config: RestartConfig = RestartConfig(), rng: random.Random | None = None) -> None:
        self.config = config
        self._rng = rng or random.Random()
        self._deaths: deque[float] = deque()

    def on_death(self, now_s: float) -> Decision:
        """Record a death at ``now_s`` (a monotonic clock) and decide what to do."""
        cfg = self.config
        self._deaths.append(now_s)
        while self._deaths and self._deaths[0] <= now_s - cfg.window_s:
            self._deaths.popleft()
        n = len(self._deaths)
        if n >= cfg.max_deaths:
            return Decision(restart=False, delay_s=0.0, num_recent_deaths=n)
        step = min(cfg.max_delay_s, cfg.base_delay_s * 2 ** (n - 1))
        return Decision(restart=True, delay_s=step * self._rng.uniform(1 - cfg.jitter, 1.0), num_recent_deaths=n)

    def reset(self) -> None:
        """Forget past deaths (an operator restarted the instance on purpose)."""
        self._deaths.clear()
