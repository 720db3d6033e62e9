"""A stall mid-stream is acted on at the stall ceiling, not at the first-token ceiling.

Issue 16 replaced the router's and the scheduler's per-read ``asyncio.wait(timeout=...)``
by one lazily armed timer per stream, which fires at the deadline of the read that armed
it. The first read arms it with the first-token ceiling (the scheduler's
``first_token_timeout_s``, 60 s by default; the router's ``first_chunk_probe_s``, 5 s),
and later reads found it armed and left it so, although their own ceiling (the stall
ceiling: ``min_stall_s``, 2 s by default, or ``stall_factor`` x the mean gap) is far
shorter. An executor that hung a second into a stream was then left only a minute after
the stream began (and a scheduler that stopped was probed only at 5 s): found by pausing an
executor of a real mesh for 3 s mid-stream, which migrated no stream (before the change, a
stall past ``min_stall_s`` migrated them all).

Here the first-token ceiling is an hour and the stall ceiling 50 ms: the stall must be
acted on (a bound of SAFETY_S on the whole test catches a wait for the hour).
"""
from __future__ import annotations

import asyncio

import pytest

from services.router.continuation import ContinuationPolicy, SchedulerLiveness, _WatchedStream
from services.router.errors import UpstreamUnavailable
from services.router.schema import TokenChunk
from services.scheduler.migration import Attempt, MigrationPolicy, NoReplacement, Piece, StreamProgress, migrating_stream

HOUR_S = 3600.0
SAFETY_S = 10.0  # a bound on a hang, far above the 50 ms ceiling and far below the hour


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, SAFETY_S))


class Executors:
    """``hang_after[name]``: that executor goes silent after so many tokens (None: never)."""

    def __init__(self, hang_after: dict[str, int | None]) -> None:
        self.hang_after = hang_after
        self.opened: list[str] = []

    def open(self, attempt: Attempt):
        for name, hang in self.hang_after.items():
            if name not in attempt.exclude:
                self.opened.append(name)
                return self._stream(name, hang, attempt)
        raise NoReplacement("every executor failed")

    async def _stream(self, name: str, hang: int | None, attempt: Attempt):
        start = len(attempt.prompt_token_ids)
        for i in range(attempt.max_tokens):
            if hang is not None and i == hang:
                await asyncio.Event().wait()
            yield Piece((start + i,), name, i + 1 == attempt.max_tokens)


def test_an_executor_hung_mid_stream_is_left_at_the_stall_ceiling_not_the_first_token_one():
    policy = MigrationPolicy(max_attempts=2, stall_factor=5, min_stall_s=0.05, first_token_timeout_s=HOUR_S)

    async def main():
        executors = Executors({"a": 3, "b": None})
        prog = StreamProgress((0,), max_tokens=8, min_tokens=0, seed=None)
        pieces = [p async for p in migrating_stream(prog, policy, executors.open, lambda e, x: False)]
        return pieces, prog, executors

    pieces, prog, executors = run(main())
    assert [t for p in pieces for t in p.token_ids] == list(range(1, 9))
    assert executors.opened == ["a", "b"] and prog.num_migrations == 1


def test_a_scheduler_silent_mid_stream_is_given_up_on_at_the_stall_ceiling_not_the_first_chunk_one():
    policy = ContinuationPolicy(min_stall_s=0.05, first_chunk_probe_s=HOUR_S, probe_timeout_s=0.05, probe_attempts=1)

    async def chunks():
        for i in range(3):
            yield TokenChunk((i,), (), None, 4, 0, i + 1, "executor-0")
        await asyncio.Event().wait()  # silent, and no probe is answered

    async def unanswered(timeout_s: float) -> bool:
        await asyncio.sleep(timeout_s)  # the probe's own deadline passes unanswered
        return False

    async def main():
        stream = _WatchedStream(chunks(), policy, SchedulerLiveness(policy, unanswered))
        try:
            got = [(await stream.next()).token_ids[0] for _ in range(3)]
            with pytest.raises(UpstreamUnavailable) as lost:
                await stream.next()
            return got, lost.value
        finally:
            await stream.aclose()

    got, lost = run(main())
    assert got == [0, 1, 2]
    assert lost.lost
