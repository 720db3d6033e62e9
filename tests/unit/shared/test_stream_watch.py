"""The shared stall watch on reads (services/shared/stream_watch.py, ``WatchedReads``):
one lazily armed timer per stream in the reader's own task; a verdict fails the read in
progress, None waits a further period, a shorter ceiling brings the timer forward, an
awaitable verdict counts only for the read it judged, and a check that raises fails the
read with ``StallCheckFailed`` instead of escaping into the event loop and leaving the
read unwatched."""
from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from services.shared.stream_resume import StallRule, StallWatch
from services.shared.stream_watch import StallCheckFailed, WatchedReads
from tests.waiting import GatedSource

HOUR_S = 3600.0
SAFETY_S = 10.0  # every test's outer bound: a hang fails, it never blocks the suite


class Boom(Exception):
    pass


def watch(first_s: float = 0.05, stall_s: float = 0.05) -> StallWatch:
    return StallWatch(StallRule(stall_factor=1.0, min_stall_s=stall_s, first_token_timeout_s=first_s))


def run(coro):
    """Run ``coro``; also return what reached the event loop's exception handler."""
    async def main():
        unhandled: list[dict] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: unhandled.append(context))
        return await asyncio.wait_for(coro, SAFETY_S), unhandled

    return asyncio.run(main())


def test_reads_start_no_task_and_an_idle_watch_leaves_nothing_armed_after_close():
    async def main():
        loop = asyncio.get_running_loop()
        started: list[object] = []
        loop.set_task_factory(lambda loop, coro, **kw: started.append(coro) or asyncio.Task(coro, loop=loop, **kw))
        source = GatedSource()
        reads = WatchedReads(source.items(), watch(), lambda silent_s: Boom())
        source.give(30)
        try:
            got = [await reads.next() for _ in range(30)]
        finally:
            loop.set_task_factory(None)
            reads.close()
        return got, started, reads._timer

    (got, started, timer), unhandled = run(main())
    assert got == list(range(30)) and started == [] and timer is None and unhandled == []


def test_a_verdict_fails_the_read_in_progress_and_the_cancellation_is_taken_back():
    async def main():
        source = GatedSource()
        reads = WatchedReads(source.items(), watch(), lambda silent_s: Boom(f"silent {silent_s}"))
        with pytest.raises(Boom, match="silent 0.05"):
            await reads.next()
        return asyncio.current_task().cancelling()

    cancelling, unhandled = run(main())
    assert cancelling == 0 and unhandled == []


def test_no_verdict_waits_a_further_period_on_the_same_read():
    async def main():
        source = GatedSource()
        calls: list[float] = []

        def stalled(silent_s: float):
            calls.append(silent_s)
            if len(calls) == 2:
                source.give()  # the upstream wakes during the second further period
            return None

        reads = WatchedReads(source.items(), watch(), stalled)
        item = await reads.next()
        reads.close()
        return item, calls

    (item, calls), _ = run(main())
    assert item == 0 and len(calls) == 2


def test_a_read_with_a_shorter_ceiling_brings_the_armed_timer_forward():
    async def main():
        source = GatedSource()
        w = watch(first_s=HOUR_S, stall_s=0.05)
        reads = WatchedReads(source.items(), w, lambda silent_s: Boom())
        source.give()
        await reads.next()  # armed for the hour
        w.observe()
        w.observe()  # a mean gap: now the stall ceiling applies, 50 ms
        with pytest.raises(Boom):
            await reads.next()

    run(main())


def test_a_client_cancel_stays_a_cancellation():
    async def main():
        source = GatedSource()
        reads = WatchedReads(source.items(), watch(first_s=HOUR_S), lambda silent_s: Boom())
        reader = asyncio.ensure_future(reads.next())
        await source.waiting.wait()
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        reads.close()

    run(main())


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_stall_check_that_raises_fails_the_read_and_logs_once(kind):
    async def main():
        def sync_check(silent_s: float):
            raise Boom("the check's own bug")

        async def async_check(silent_s: float):
            raise Boom("the check's own bug")

        source = GatedSource()
        reads = WatchedReads(source.items(), watch(), sync_check if kind == "sync" else async_check)
        with capture_logs() as logs, pytest.raises(StallCheckFailed) as info:
            await reads.next()
        reads.close()
        return info.value, logs, asyncio.current_task().cancelling()

    (error, logs, cancelling), unhandled = run(main())
    assert isinstance(error.__cause__, Boom) and "the check's own bug" in str(error)
    assert [e["event"] for e in logs] == ["stall_check_failed"]
    assert unhandled == [] and cancelling == 0


def test_an_awaited_verdict_counts_only_for_the_read_it_judged():
    """Read 0 stalls; its check is slow; item 0 arrives and read 1 starts before the check
    ends: the check's verdict is void, and read 1 gets its own check at its own ceiling."""
    async def main():
        source = GatedSource()
        gate = asyncio.Event()
        calls: list[int] = []

        async def stalled(silent_s: float):
            calls.append(len(calls))
            if len(calls) == 1:
                source.give()  # the item comes while the check is still out
                await gate.wait()
                return Boom("for read 0")
            return Boom("for read 1")

        reads = WatchedReads(source.items(), watch(), stalled)
        assert await reads.next() == 0
        reader = asyncio.ensure_future(reads.next())
        await source.waiting.wait()
        gate.set()
        with pytest.raises(Boom) as info:
            await reader
        reads.close()
        return str(info.value), calls

    (which, calls), unhandled = run(main())
    assert which == "for read 1" and calls == [0, 1] and unhandled == []


def test_close_cancels_a_check_in_flight():
    async def main():
        source = GatedSource()
        entered = asyncio.Event()
        cancelled = asyncio.Event()

        async def stalled(silent_s: float):
            entered.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise

        reads = WatchedReads(source.items(), watch(), stalled)
        reader = asyncio.ensure_future(reads.next())
        await entered.wait()
        reads.close()
        await cancelled.wait()
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        return reads._check

    check, unhandled = run(main())
    assert check is None and unhandled == []
