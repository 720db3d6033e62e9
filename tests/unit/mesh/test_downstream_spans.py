"""``timeline.downstream_spans`` reads a finished call's trailers in the caller's task (no
task per call, issue 16), returns their spans, and yields none for a slow peer, a failed
call or malformed trailers."""
from __future__ import annotations

import asyncio

import grpc

from services.mesh import timeline
from services.mesh.timeline import Span, spans_metadata

SAFETY_S = 20.0


class _Call:
    def __init__(self, metadata=None, error: Exception | None = None, hang: bool = False) -> None:
        self.metadata = metadata
        self.error = error
        self.hang = hang

    async def trailing_metadata(self):
        if self.hang:
            await asyncio.Event().wait()
        if self.error is not None:
            raise self.error
        return self.metadata


def _span() -> Span:
    return Span("t" * 32, "s" * 16, "p" * 16, "executor.step", "executor", 1, 2, {"n": 1})


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, SAFETY_S))


def test_the_trailers_spans_are_returned_without_starting_a_task():
    async def main():
        loop = asyncio.get_running_loop()
        started: list[object] = []

        def factory(loop, coro, **kwargs):
            started.append(coro)
            return asyncio.Task(coro, loop=loop, **kwargs)

        loop.set_task_factory(factory)
        try:
            spans = await timeline.downstream_spans(_Call(spans_metadata([_span()])))
        finally:
            loop.set_task_factory(None)
        return spans, started

    spans, started = run(main())
    assert spans == [_span()]
    assert started == []


def test_a_slow_peer_a_failed_call_or_malformed_trailers_yield_no_spans():
    async def main():
        slow = await timeline.downstream_spans(_Call(hang=True), timeout_s=0.05)
        failed = await timeline.downstream_spans(_Call(error=grpc.aio.AioRpcError(
            grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata())))
        malformed = await timeline.downstream_spans(_Call(((timeline.SPANS_KEY, "not json"),)))
        return slow, failed, malformed, asyncio.current_task().cancelling()

    slow, failed, malformed, cancelling = run(main())
    assert slow == [] and failed == [] and malformed == []
    assert cancelling == 0  # the timeout's cancellation was taken back
