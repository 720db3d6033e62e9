"""The stall watch of the router's continuation (services/router/continuation.py,
``_WatchedStream``) reads in the caller's own task, under one lazily armed timer per
stream: no task per chunk on the first-token path (issue 16), and the same verdicts as
before: a silent scheduler with no sign of life is lost, a live one is waited on, a
cancellation from the client stays a cancellation, and a consumer that is slow between
chunks is never mistaken for a stalled scheduler."""
from __future__ import annotations

import asyncio

import pytest

from services.router.continuation import ContinuationPolicy, SchedulerLiveness, _WatchedStream
from services.router.errors import UpstreamUnavailable
from services.router.schema import TokenChunk
from services.shared.stream_watch import StallCheckFailed

POLICY = ContinuationPolicy(min_stall_s=0.05, first_chunk_probe_s=0.05, probe_timeout_s=0.05, probe_attempts=1)
SAFETY_S = 20.0


def chunk(i: int) -> TokenChunk:
    return TokenChunk((i,), (), None, 4, 0, i + 1, "executor-0")


class Source:
    """A chunk stream: ``n`` chunks at once, then silent until ``release`` is set (or for
    ever); records that it was closed."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.release = asyncio.Event()
        self.waiting = asyncio.Event()  # set once it went silent
        self.closed = False

    async def stream(self):
        try:
            for i in range(self.n):
                yield chunk(i)
            self.waiting.set()
            await self.release.wait()
            yield chunk(self.n)
        finally:
            self.closed = True


def watched(source: Source, alive: bool) -> tuple[_WatchedStream, list[float]]:
    probes: list[float] = []

    async def probe(timeout_s: float) -> bool:
        probes.append(timeout_s)
        return alive

    return _WatchedStream(source.stream(), POLICY, SchedulerLiveness(POLICY, probe)), probes


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, SAFETY_S))


def test_reading_chunks_starts_no_task_per_chunk():
    async def main():
        loop = asyncio.get_running_loop()
        started: list[object] = []

        def factory(loop, coro, **kwargs):
            started.append(coro)
            return asyncio.Task(coro, loop=loop, **kwargs)

        source = Source(50)
        stream, _ = watched(source, alive=True)
        loop.set_task_factory(factory)
        try:
            got = [(await stream.next()).token_ids[0] for _ in range(50)]
        finally:
            loop.set_task_factory(None)
            await stream.aclose()
        return got, started

    got, started = run(main())
    assert got == list(range(50))
    assert started == []


def test_a_silent_stream_with_no_sign_of_life_is_lost_and_its_source_closed():
    async def main():
        source = Source(2)
        stream, probes = watched(source, alive=False)
        assert [(await stream.next()).token_ids for _ in range(2)] == [(0,), (1,)]
        with pytest.raises(UpstreamUnavailable) as info:
            await stream.next()
        await stream.aclose()
        return info.value, probes, source.closed, asyncio.current_task().cancelling()

    error, probes, closed, cancelling = run(main())
    assert error.lost and "no chunk" in str(error)
    assert probes and closed
    assert cancelling == 0  # the verdict's cancellation was taken back: the task goes on normally


def test_a_silent_stream_whose_scheduler_answers_is_waited_on():
    async def main():
        source = Source(1)
        stream, probes = watched(source, alive=True)
        await stream.next()

        async def release_after_a_probe():
            while not probes:
                await asyncio.sleep(0.01)
            source.release.set()

        releaser = asyncio.ensure_future(release_after_a_probe())
        got = await stream.next()
        await releaser
        await stream.aclose()
        return got, probes

    got, probes = run(main())
    assert got.token_ids == (1,) and probes


def test_a_client_cancel_during_a_read_stays_a_cancellation():
    async def main():
        source = Source(0)
        stream, _ = watched(source, alive=True)
        reader = asyncio.ensure_future(stream.next())
        await source.waiting.wait()
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        await stream.aclose()
        return source.closed

    assert run(main())


def test_a_consumer_slow_between_chunks_is_not_a_stall():
    """No read in progress: the timer that comes due finds nothing to judge, and the
    consumer's own task is never cancelled."""
    async def main():
        source = Source(3)
        stream, probes = watched(source, alive=False)
        await stream.next()
        await asyncio.sleep(POLICY.first_chunk_probe_s * 4)  # the consumer is busy past the ceiling
        rest = [(await stream.next()).token_ids for _ in range(2)]
        await stream.aclose()
        return rest, probes

    rest, probes = run(main())
    assert rest == [(1,), (2,)] and probes == []


def test_a_liveness_check_that_raises_fails_the_read_instead_of_hanging():
    """The check is the router's bug, not a verdict on the scheduler: the read fails with
    ``StallCheckFailed`` (its cause chained), never waits unwatched for ever."""
    def unreachable() -> bool:
        raise RuntimeError("channel state unreadable")

    async def main():
        source = Source(1)
        stream = _WatchedStream(source.stream(), POLICY, SchedulerLiveness(POLICY, None, unreachable))
        await stream.next()
        with pytest.raises(StallCheckFailed) as info:
            await stream.next()
        await stream.aclose()
        return info.value, source.closed

    error, closed = run(main())
    assert isinstance(error.__cause__, RuntimeError) and closed
