"""Reads under a stall watch: the mechanism that notices a silent upstream mid-read.

NOTE: shared one level apart, like the resume point (``stream_resume.py``): the scheduler
watches an executor's stream (``services/scheduler/migration.py``), the router a
scheduler's (``services/router/continuation.py``). Each supplies the policy, a
``stalled(silent_s)`` callback that gives the verdict on a read past its ceiling; this
module only times the reads. The read runs in the caller's own task under one lazily
armed timer per stream: no task and no ``asyncio.wait`` per item (they cost ~10 us and
event-loop turns on every chunk, the first included)::

    next() ─ arm by since + ceiling ─┬─ item comes   → return it (the timer stays armed)
                                     └─ timer fires  → read in progress and past its own
                                                       ceiling? ask stalled(silent_s)

The timer fires at the deadline of the read that armed it; finding a later read in
progress it re-arms for that one, finding none it lapses (the next read arms it again).
A read whose own deadline comes sooner brings it forward (the first item's long ceiling
gives way to the short stall ceiling: left armed, a hang early in a stream was judged
only at the first ceiling). The verdict is None (wait a further period on the same read)
or an exception: the reader is cancelled inside ``next``, which raises that exception
instead (as ``asyncio.timeout`` does, ``uncancel``). A cancellation from elsewhere (the
client left) stays a cancellation. ``stalled`` may be a coroutine function: it then runs
as a task (only then, once per stall), and its verdict counts only if the read it judged
is still in progress.

A ``stalled`` that raises is a bug in the caller's check, not a verdict on the upstream:
the read fails with ``StallCheckFailed`` (the cause chained, logged once as
``stall_check_failed``) rather than the error escaping into the event loop and the read
waiting unwatched for ever.
"""
from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Generic, TypeVar

import structlog

from services.shared.stream_resume import StallWatch

log = structlog.get_logger(__name__)

T = TypeVar("T")
Verdict = BaseException | None  # None: wait a further period; an exception: the read raises it
Stalled = Callable[[float], Verdict | Awaitable[Verdict]]  # stalled(silent_s): a read passed its ceiling


class StallCheckFailed(RuntimeError):
    """The stall check itself raised: the stalled read fails with this (``__cause__``: the error)."""


class WatchedReads(Generic[T]):
    """The reads of one stream under ``watch``, each in the reader's own task.

    Mutates only its own timer state; the caller observes items on ``watch`` (what counts
    as progress is its business) and closes ``source`` itself."""

    def __init__(self, source: AsyncIterator[T], watch: StallWatch, stalled: Stalled) -> None:
        self.source = source
        self.watch = watch
        self.stalled = stalled
        self._reader: asyncio.Task | None = None  # the task inside ``next`` now; None between reads
        self._num_reads = 0  # identifies the read in progress to a check that outlasts it
        self._since_s = 0.0  # when that read started (or its last further period did)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due_s = 0.0  # when it fires (the watch's clock)
        self._check: asyncio.Task | None = None  # an awaitable verdict in flight
        self._failed: BaseException | None = None  # the verdict that cancelled the reader

    async def next(self) -> T:
        """The source's next item (StopAsyncIteration at its end)."""
        reader = self._reader = asyncio.current_task()
        self._num_reads += 1
        self._since_s = self.watch.clock()
        if self._check is None:  # a check in flight re-arms when it ends
            self._arm_by(self._since_s + self.watch.timeout_s())
        try:
            item = await anext(self.source)
        except asyncio.CancelledError:
            if self._failed is not None and reader.uncancel() == 0:
                raise self._failed from self._failed.__cause__
            raise
        finally:
            self._reader = None
        if self._failed is not None:  # the cancellation was swallowed below: the verdict stands
            reader.uncancel()
            raise self._failed
        return item

    def close(self) -> None:
        """Stop watching: cancel the timer and any check in flight (the source stays open)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._check is not None:
            self._check.cancel()

    def _arm_by(self, due_s: float) -> None:
        """Have the timer fire no later than ``due_s``: arm it, or bring it forward."""
        if self._timer is not None:
            if self._timer_due_s <= due_s:
                return
            self._timer.cancel()
        self._timer_due_s = due_s
        delay_s = max(0.0, due_s - self.watch.clock())
        self._timer = asyncio.get_running_loop().call_later(delay_s, self._due)

    def _due(self) -> None:
        """The timer: act only when the read in progress is past its own ceiling."""
        self._timer = None
        if self._reader is None:
            return  # between reads: the next read arms it again
        silent_s = self.watch.timeout_s()
        due_s = self._since_s + silent_s
        if self.watch.clock() < due_s:
            self._arm_by(due_s)  # a later read than the one that armed it
            return
        try:
            verdict = self.stalled(silent_s)
        except Exception as exc:  # noqa: BLE001 - a broken check must not escape into the loop
            self._act(_check_failed(exc, silent_s))
            return
        if inspect.isawaitable(verdict):
            self._check = asyncio.ensure_future(self._await_verdict(verdict, self._num_reads, silent_s))
        else:
            self._act(verdict)

    async def _await_verdict(self, verdict: Awaitable[Verdict], read: int, silent_s: float) -> None:
        try:
            outcome = await verdict
        except asyncio.CancelledError as exc:
            if asyncio.current_task().cancelling():
                raise  # closed: the stream is done with
            outcome = _check_failed(exc, silent_s)  # something the check awaited was cancelled
        except Exception as exc:  # noqa: BLE001 - a broken check must not die unretrieved in its task
            outcome = _check_failed(exc, silent_s)
        finally:
            self._check = None
        if self._reader is None:
            return  # the item came meanwhile (or the stream closed)
        if read != self._num_reads:  # a later read began meanwhile, unwatched: watch it
            self._arm_by(self._since_s + self.watch.timeout_s())
            return
        self._act(outcome)

    def _act(self, verdict: Verdict) -> None:
        assert self._reader is not None
        if verdict is None:
            self._since_s = self.watch.clock()  # wait a further period on the same read
            self._arm_by(self._since_s + self.watch.timeout_s())
            return
        self._failed = verdict
        self._reader.cancel()


def _check_failed(exc: BaseException, silent_s: float) -> StallCheckFailed:
    log.error("stall_check_failed", silent_s=round(silent_s, 2), exc_info=exc)
    failed = StallCheckFailed(f"the stall check raised after {silent_s:.1f}s without an item: {exc!r}")
    failed.__cause__ = exc
    return failed
