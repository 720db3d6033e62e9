"""What the relay keeps off a request's first-token path (issue 16, mesh overhead): the
placement's metrics and its ``request_placed`` log line are recorded after the first chunk
was handed on, and still exactly once, also when the consumer stops at that chunk; the
executor's spans (its call's trailers) are read after its last chunk went on, and still
reach the request's timeline before it is finished."""
from __future__ import annotations

import asyncio

from services.scheduler.dispatch import relay
from services.scheduler.dispatch.dispatcher import Dispatcher
from services.mesh.timeline import Span
from services.scheduler.dispatch.job import Chunk, Job
from services.scheduler.policy.admission import Admission
from tests.unit.scheduler.test_dispatcher import ByName, FakePort, FakeStream, mesh


def _placed(executor: str) -> float:
    return relay.PLACED.labels(executor)._value.get()


def _dispatcher() -> Dispatcher:
    return Dispatcher(mesh("a"), ByName(), Admission(4, 4), FakePort({"a": "ok"}))


def test_the_placement_is_counted_after_the_first_chunk_reaches_the_consumer_and_once(monkeypatch):
    lines: list[dict] = []
    monkeypatch.setattr(relay, "log", _Recorder(lines))
    dispatcher, before = _dispatcher(), _placed("a")

    async def main():
        seen = []
        async for chunk in dispatcher.generate(Job("r1", [1, 2, 3], "m", "t", max_tokens=3), lambda spans: None):
            seen.append((_placed("a") - before, len(lines)))  # what was recorded when this chunk arrived
        return seen

    seen = asyncio.run(asyncio.wait_for(main(), 10))
    assert seen[0] == (0, 0)  # nothing recorded ahead of the first chunk
    assert seen[1:] == [(1, 1), (1, 1)]  # recorded once it went on, and only once
    assert lines == [{"event": "request_placed", "executor": "a", "num_matched_blocks": 0, "queue_ms": 0}]


def test_a_consumer_that_stops_at_the_first_chunk_still_gets_its_placement_counted(monkeypatch):
    lines: list[dict] = []
    monkeypatch.setattr(relay, "log", _Recorder(lines))
    dispatcher, before = _dispatcher(), _placed("a")

    async def main():
        stream = dispatcher.generate(Job("r2", [1, 2, 3], "m", "t", max_tokens=5), lambda spans: None)
        first = await anext(stream)
        await stream.aclose()  # the client went away after its first token
        return first

    first = asyncio.run(asyncio.wait_for(main(), 10))
    assert first.token_ids and not first.finished
    assert _placed("a") - before == 1
    assert [line["event"] for line in lines] == ["request_placed"]


EXECUTOR_SPAN = Span("t" * 32, "e" * 16, "p" * 16, "executor.request", "executor", 1, 2)


class TrailedStream(FakeStream):
    """One finished chunk whose executor spans (trailers) come only once ``trailers`` is set."""

    def __init__(self, call, trailers: asyncio.Event) -> None:
        super().__init__("ok", call, "a")
        self.trailers = trailers

    async def __aiter__(self):
        async def spans():
            await self.trailers.wait()
            return [EXECUTOR_SPAN]
        yield Chunk((9,), True, "a", num_prompt_tokens=3, num_output_tokens=1, trailer_spans=spans)


class TrailedPort(FakePort):
    def __init__(self, trailers: asyncio.Event) -> None:
        super().__init__({"a": "ok"})
        self.trailers = trailers

    def generate(self, address, call, timeout_s, traceparent):
        self.calls.append((address, call))
        return TrailedStream(call, self.trailers)


def test_a_one_chunk_reply_goes_on_before_the_executor_trailers_and_the_timeline_still_gets_them():
    async def main():
        trailers = asyncio.Event()
        dispatcher = Dispatcher(mesh("a"), ByName(), Admission(4, 4), TrailedPort(trailers))
        finished: list[list[Span]] = []
        stream = dispatcher.generate(Job("r3", [1, 2, 3], "m", "t", max_tokens=1), finished.append)
        # The old relay read the trailers before handing the chunk on: this wait ran out.
        chunk = await asyncio.wait_for(anext(stream), 5)
        assert chunk.finished and chunk.token_ids == (9,) and finished == []
        trailers.set()  # they follow the last message on the wire
        assert [c async for c in stream] == []
        return finished

    finished = asyncio.run(asyncio.wait_for(main(), 10))
    assert len(finished) == 1 and EXECUTOR_SPAN in finished[0]  # in the scheduler's spans when it finished


class _Recorder:
    """Stands in for the relay's structlog logger: keeps each line as a dict."""

    def __init__(self, lines: list[dict]) -> None:
        self.lines = lines

    def info(self, event: str, **fields) -> None:
        self.lines.append({"event": event, **fields})

    warning = error = info
