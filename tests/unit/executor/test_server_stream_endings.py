"""The executor's Generate reads the engine's outputs in its own handler task (no pump task
and queue between them: one event-loop turn less before each chunk goes out, issue 16),
and still ends as before: ``Abort`` with a FINISH_REASON_ABORT chunk, a dead engine
(``fail_streams``) with EngineDeadError, whether the stream waits on the engine or is
between reads, and a client's cancellation stays a cancellation that closes the engine
stream (which aborts the request in the engine)."""
from __future__ import annotations

import asyncio

import pytest

from services.executor.engine.async_engine import EngineDeadError
from services.executor.engine.engine import StepOutput
from services.executor.server import ExecutorServicer
from weft.v1 import common_pb2, executor_pb2

SAFETY_S = 20.0


class _Engine:
    """An AsyncEngine stand-in: ``num_outputs`` outputs at once, then silent until closed
    (or the last one, finished, when ``finish`` is set)."""

    def __init__(self, num_outputs: int, finish: bool = False) -> None:
        self.num_outputs = num_outputs
        self.finish = finish
        self.waiting = asyncio.Event()  # set once it went silent
        self.closed = False
        self.aborted: list[str] = []

    async def generate(self, request_id, prompt_token_ids, params, **kwargs):
        try:
            for i in range(self.num_outputs):
                last = self.finish and i + 1 == self.num_outputs
                yield StepOutput(request_id, (100 + i,), (), last, None, len(prompt_token_ids), 0, i + 1)
            self.waiting.set()
            await asyncio.Event().wait()
        finally:
            self.closed = True

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


class _Context:
    def invocation_metadata(self):
        return ()

    def time_remaining(self):
        return None

    def set_trailing_metadata(self, metadata) -> None:
        self.trailers = metadata


def _request(rid: str = "r1") -> executor_pb2.ExecuteRequest:
    return executor_pb2.ExecuteRequest(request_id=rid, prompt_token_ids=[1, 2, 3],
                                       sampling=common_pb2.SamplingParams(max_tokens=8))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, SAFETY_S))


def test_outputs_reach_the_stream_without_a_task_per_request_or_chunk():
    async def main():
        loop = asyncio.get_running_loop()
        started: list[object] = []

        def factory(loop, coro, **kwargs):
            started.append(coro)
            return asyncio.Task(coro, loop=loop, **kwargs)

        engine = _Engine(5, finish=True)
        servicer = ExecutorServicer(engine, "executor-0", "tiny", 16)
        loop.set_task_factory(factory)
        try:
            chunks = [c async for c in servicer.Generate(_request(), _Context())]
        finally:
            loop.set_task_factory(None)
        return chunks, started

    chunks, started = run(main())
    assert [list(c.token_ids_delta) for c in chunks] == [[100], [101], [102], [103], [104]]
    assert started == []


@pytest.mark.parametrize("waiting", [True, False], ids=["waiting_on_the_engine", "between_reads"])
def test_abort_ends_the_stream_with_an_abort_chunk_and_closes_the_engine_stream(waiting):
    async def main():
        engine = _Engine(1)
        servicer = ExecutorServicer(engine, "executor-0", "tiny", 16)
        stream = servicer.Generate(_request(), _Context())
        first = await anext(stream)
        if waiting:
            reader = asyncio.ensure_future(anext(stream))
            await engine.waiting.wait()
            assert (await servicer.Abort(executor_pb2.AbortRequest(request_id="r1"), None)).aborted
            last = await reader
        else:
            assert (await servicer.Abort(executor_pb2.AbortRequest(request_id="r1"), None)).aborted
            last = await anext(stream)
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        return first, last, engine, asyncio.current_task().cancelling()

    first, last, engine, cancelling = run(main())
    assert list(first.token_ids_delta) == [100]
    assert last.finish_reason == common_pb2.FINISH_REASON_ABORT and not last.token_ids_delta
    assert engine.closed and "r1" in engine.aborted
    assert cancelling == 0


@pytest.mark.parametrize("waiting", [True, False], ids=["waiting_on_the_engine", "between_reads"])
def test_a_dead_engine_ends_the_stream_with_engine_dead_error(waiting):
    async def main():
        engine = _Engine(1)
        servicer = ExecutorServicer(engine, "executor-0", "tiny", 16)
        stream = servicer.Generate(_request(), _Context())
        await anext(stream)
        if waiting:
            reader = asyncio.ensure_future(anext(stream))
            await engine.waiting.wait()
            assert servicer.fail_streams("engine wedged") == 1
        else:
            assert servicer.fail_streams("engine wedged") == 1
            reader = asyncio.ensure_future(anext(stream))
        with pytest.raises(EngineDeadError, match="engine wedged"):
            await reader
        return engine

    engine = run(main())
    assert engine.closed and "r1" in engine.aborted


def test_a_client_cancel_while_waiting_on_the_engine_stays_a_cancellation():
    async def main():
        engine = _Engine(0)
        servicer = ExecutorServicer(engine, "executor-0", "tiny", 16)

        async def consume():
            return [c async for c in servicer.Generate(_request(), _Context())]

        consumer = asyncio.ensure_future(consume())
        await engine.waiting.wait()
        consumer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await consumer
        return engine, servicer

    engine, servicer = run(main())
    assert engine.closed and "r1" in engine.aborted
    assert not servicer._streams  # the request id is free again
