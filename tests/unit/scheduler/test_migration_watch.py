"""The stall watch of the scheduler's migration (services/scheduler/migration.py,
``_WatchedReads``) reads in the consumer's own task, under one lazily armed timer per
attempt: no task per piece on the first-token path (issue 16), and the same verdicts as
before: a hung executor is left for another, a cancellation from the client stays a
cancellation (no migration), and a consumer that is slow between pieces is never
mistaken for a hung executor."""
from __future__ import annotations

import asyncio

import pytest

from services.scheduler.migration import Attempt, MigrationPolicy, NoReplacement, Piece, StreamProgress, migrating_stream
from services.shared.stream_watch import StallCheckFailed

POLICY = MigrationPolicy(max_attempts=3, stall_factor=5, min_stall_s=0.05, first_token_timeout_s=0.1,
                         replacement_wait_s=0.3)
SAFETY_S = 20.0


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, SAFETY_S))


class Executors:
    """``hang_after[name]``: that executor goes silent after so many tokens (None: never).
    Token i of an attempt is its resume offset + i, so a continuation is visible."""

    def __init__(self, hang_after: dict[str, int | None]) -> None:
        self.hang_after = hang_after
        self.opened: list[str] = []
        self.closed: list[str] = []
        self.silent = asyncio.Event()

    def open(self, attempt: Attempt):
        for name, hang in self.hang_after.items():
            if name not in attempt.exclude:
                self.opened.append(name)
                return self._stream(name, hang, attempt)
        raise NoReplacement("every executor failed")

    async def _stream(self, name: str, hang: int | None, attempt: Attempt):
        start = len(attempt.prompt_token_ids)
        try:
            for i in range(attempt.max_tokens):
                if hang is not None and i == hang:
                    self.silent.set()
                    await asyncio.Event().wait()
                yield Piece((start + i,), name, i + 1 == attempt.max_tokens)
        finally:
            self.closed.append(name)


def progress(max_tokens: int) -> StreamProgress:
    return StreamProgress((0,), max_tokens=max_tokens, min_tokens=0, seed=None)


def test_reading_pieces_starts_no_task_per_piece():
    async def main():
        loop = asyncio.get_running_loop()
        started: list[object] = []

        def factory(loop, coro, **kwargs):
            started.append(coro)
            return asyncio.Task(coro, loop=loop, **kwargs)

        executors = Executors({"a": None})
        loop.set_task_factory(factory)
        try:
            pieces = [p async for p in migrating_stream(progress(40), POLICY, executors.open)]
        finally:
            loop.set_task_factory(None)
        return pieces, started

    pieces, started = run(main())
    assert [t for p in pieces for t in p.token_ids] == list(range(1, 41))
    assert started == []


def test_a_hung_executor_is_left_for_another_and_the_stream_continues():
    async def main():
        executors = Executors({"a": 3, "b": None})
        prog = progress(8)
        pieces = [p async for p in migrating_stream(prog, POLICY, executors.open, lambda e, x: False)]
        return pieces, prog, executors, asyncio.current_task().cancelling()

    pieces, prog, executors, cancelling = run(main())
    assert [t for p in pieces for t in p.token_ids] == list(range(1, 9))
    assert executors.opened == ["a", "b"] and "a" in executors.closed
    assert prog.failed_executors == {"a"} and prog.num_migrations == 1
    assert cancelling == 0  # the verdict's cancellation was taken back


def test_a_client_cancel_during_a_read_stays_a_cancellation_and_migrates_nothing():
    async def main():
        executors = Executors({"a": 2, "b": None})
        prog = progress(8)

        async def consume():
            return [p async for p in migrating_stream(prog, POLICY, executors.open, lambda e, x: False)]

        consumer = asyncio.ensure_future(consume())
        await executors.silent.wait()
        consumer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await consumer
        return prog, executors

    prog, executors = run(main())
    assert executors.opened == ["a"] and executors.closed == ["a"]
    assert prog.num_migrations == 0 and prog.failed_executors == set()


def test_a_consumer_slow_between_pieces_is_not_a_stall():
    async def main():
        executors = Executors({"a": None, "b": None})
        prog = progress(4)
        got = []
        async for piece in migrating_stream(prog, POLICY, executors.open, lambda e, x: False):
            got.append(piece.token_ids[0])
            if len(got) == 1:
                await asyncio.sleep(POLICY.first_token_timeout_s * 4)  # busy past the ceiling
        return got, prog, executors

    got, prog, executors = run(main())
    assert got == [1, 2, 3, 4]
    assert executors.opened == ["a"] and prog.num_migrations == 0


def test_a_stall_check_that_raises_ends_the_stream_with_an_error_not_a_hang():
    """``only_live`` raising is the scheduler's bug, not a verdict on the executor: the
    stream ends with ``StallCheckFailed`` (INTERNAL), migrates nothing and closes the
    executor's stream, instead of the error escaping into the event loop and the read
    waiting unwatched for ever."""
    def only_live(executor: str, exclude: frozenset[str]) -> bool:
        raise RuntimeError("membership view unreadable")

    async def main():
        executors = Executors({"a": 2, "b": None})
        prog = progress(8)
        got = []
        with pytest.raises(StallCheckFailed) as info:
            async for piece in migrating_stream(prog, POLICY, executors.open, only_live):
                got.append(piece.token_ids[0])
        return got, prog, executors, info.value

    got, prog, executors, error = run(main())
    assert got == [1, 2] and isinstance(error.__cause__, RuntimeError)
    assert executors.opened == ["a"] and executors.closed == ["a"] and prog.num_migrations == 0
