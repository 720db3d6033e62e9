"""The stream-resume point: how a stream that lost its upstream continues elsewhere.

NOTE: used one level apart by the same rule. The scheduler continues a stream whose
executor died (``services/scheduler/migration.py``); the router continues a stream whose
scheduler died (``services/router/continuation.py``). Either way the continuation is a
*new* request whose prompt is the original prompt followed by every token already sent
to the client, with ``max_tokens`` / ``min_tokens`` reduced by that many::

    original:      prompt p0..pn   → t0 t1 t2 ✗ (upstream lost after t2)
    continuation:  prompt p0..pn t0 t1 t2 → t3 t4 ...  (max_tokens - 3 left)
    client sees:   t0 t1 t2 t3 t4 ...

Greedy decoding gives the tokens an undisturbed run would (the argmax of the same
context). Seeded sampling cannot (the lost upstream's generator state went with it): the
continuation is seeded with ``continuation_seed(seed, num_sent)``, reproducible for the
same failure point, different from the undisturbed run after it.

``StallWatch`` is the shared hang rule: no token for ``stall_factor`` × the stream's mean
gap (never below ``min_stall_s``), or ``first_token_timeout_s`` before the first one.
``stream_watch.py`` applies it to the reads of a stream (the timer mechanism).
"""
from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


def continuation_seed(seed: int, num_generated: int) -> int:
    """A deterministic, well-mixed seed for the continuation after ``num_generated`` tokens."""
    digest = hashlib.blake2b(f"{seed}:{num_generated}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


@dataclass(frozen=True)
class ResumePoint:
    """Where a continuation starts: what it is asked to do after ``num_sent`` tokens."""

    prompt_token_ids: tuple[int, ...]  # original prompt + tokens already sent
    max_tokens: int  # 0 = no limit was requested
    min_tokens: int
    seed: int | None


def resume_point(prompt_token_ids: Sequence[int], sent_token_ids: Sequence[int], max_tokens: int,
                 min_tokens: int, seed: int | None) -> ResumePoint:
    """The continuation of a request (``max_tokens`` 0 = unlimited) after ``sent_token_ids``
    reached the client. Pure."""
    n = len(sent_token_ids)
    return ResumePoint(
        prompt_token_ids=tuple(prompt_token_ids) + tuple(sent_token_ids),
        max_tokens=max_tokens - n if max_tokens else 0,
        min_tokens=max(0, min_tokens - n),
        seed=continuation_seed(seed, n) if seed is not None and n else seed,
    )


def budget_spent(max_tokens: int, num_sent: int) -> bool:
    """Every requested token was sent: only the finish marker can have been lost."""
    return max_tokens > 0 and num_sent >= max_tokens


@dataclass(frozen=True)
class StallRule:
    """When a silent upstream counts as hung."""

    stall_factor: float = 20.0  # no token for stall_factor × expected step time → hung
    min_stall_s: float = 2.0  # floor of the stall ceiling (scheduling jitter, GC, shared cores)
    first_token_timeout_s: float = 60.0  # ceiling before the first token of an attempt


class StallWatch:
    """The ceiling on the wait for the next token: stall_factor × mean gap so far."""

    def __init__(self, rule: StallRule, clock: Callable[[], float] = time.monotonic) -> None:
        self.rule = rule
        self.clock = clock
        self._last_s: float | None = None
        self._mean_gap_s: float | None = None
        self._num_gaps = 0

    def restart(self) -> None:
        """A new attempt: the first token may take a prefill again."""
        self._last_s = None

    def observe(self) -> None:
        now = self.clock()
        if self._last_s is not None:
            gap = now - self._last_s
            self._num_gaps += 1
            prev = self._mean_gap_s or 0.0
            self._mean_gap_s = prev + (gap - prev) / self._num_gaps
        self._last_s = now

    def timeout_s(self) -> float:
        if self._last_s is None:
            return self.rule.first_token_timeout_s
        if self._mean_gap_s is None:
            return max(self.rule.min_stall_s, self.rule.first_token_timeout_s / 4)
        return max(self.rule.min_stall_s, self.rule.stall_factor * self._mean_gap_s)
