"""The router's verdict on a silent scheduler (services/router/continuation.py,
``SchedulerLiveness``): busy is not stalled. A chunk on any stream or an answered probe
proves it alive; stalled streams share one probe round whose probes may answer slowly; only
a round of unanswered probes, or a transport that already knows the scheduler is gone,
gives it up (issue 12: 200 concurrent streams got false 503s from a healthy scheduler).
The fakes are test_router_continuation.py's."""
from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from services.router.continuation import ContinuationPolicy, ContinuingStreamer
from services.router.scheduler_client import SchedulerClient
from services.router.schema import TokenChunk
from tests.unit.router.test_continuation import (
    FAST, ScriptedScheduler, collect, greedy_next, reference, request, run, tokens,
)

class SlowHealthScheduler(ScriptedScheduler):
    """A live scheduler whose health probe answers, but only after ``latency_s``; a probe
    given less time goes unanswered (as a gRPC deadline would). "slow" streams hold until
    a probe has been answered."""

    def __init__(self, script=(), latency_s: float = 0.0, answers: bool = True) -> None:
        super().__init__(script, alive=True)
        self.latency_s = latency_s
        self.answers = answers
        self.probe_timeouts: list[float] = []
        self.num_probing = self.max_probing = 0

    async def probe(self, timeout_s: float) -> bool:
        self.probe_timeouts.append(timeout_s)
        self.num_probing += 1
        self.max_probing = max(self.max_probing, self.num_probing)
        try:
            await asyncio.sleep(min(self.latency_s, timeout_s))
        finally:
            self.num_probing -= 1
        if self.answers and self.latency_s <= timeout_s:
            self.probed.set()
            return True
        return False


def test_a_scheduler_whose_health_answers_slowly_but_surely_is_waited_on():
    """Issue 12: a busy scheduler answered its probe after more than probe_timeout_s and the
    stream was failed over; a slow answer is an answer (the round's next probe waits longer)."""
    fake = SlowHealthScheduler([("slow", 3)], latency_s=1.5 * FAST.probe_timeout_s)
    chunks = run(collect(ContinuingStreamer(fake, replace(FAST, max_attempts=0), fake.probe)))
    assert tokens(chunks) == reference() and len(fake.requests) == 1  # never continued
    assert fake.probe_timeouts == [FAST.probe_timeout_s, 2 * FAST.probe_timeout_s]


def test_many_streams_stalled_at_once_share_one_probe():
    """A herd of stalled streams sends one probe at a time, not one each (issue 12: a herd
    of probes on a busy scheduler is what made them time out)."""
    fake = SlowHealthScheduler([("slow", 2)] * 40, latency_s=FAST.probe_timeout_s / 2)
    streamer = ContinuingStreamer(fake, replace(FAST, max_attempts=0), fake.probe)

    async def go():
        return await asyncio.gather(*(collect(streamer, replace(request(), request_id=f"r{i}")) for i in range(40)))

    results = run(go())
    assert all(tokens(chunks) == reference() for chunks in results) and len(fake.requests) == 40
    assert fake.max_probing == 1


def test_a_chunk_on_another_stream_proves_the_scheduler_alive_without_a_probe_answer():
    """One stream waits (queued behind the others) while another streams: the scheduler is
    alive even though its probes go unanswered, so the waiting stream is not failed."""
    other_done = asyncio.Event()

    class Busy(SlowHealthScheduler):
        async def generate(self, req, timeout_s):
            self.requests.append(req)
            ctx = list(req.prompt_token_ids)
            for i in range(req.sampling.max_tokens):
                if req.request_id == "waiting" and i == 2:
                    await other_done.wait()
                if req.request_id == "busy":
                    await asyncio.sleep(FAST.min_stall_s / 10)  # a steady stream of chunks
                ctx.append(greedy_next(ctx))
                last = i + 1 == req.sampling.max_tokens
                if last and req.request_id == "busy":
                    other_done.set()
                yield TokenChunk((ctx[-1],), (), "length" if last else None, 4, 0, i + 1, "e")

    fake = Busy(latency_s=60.0, answers=False)  # every probe goes unanswered
    streamer = ContinuingStreamer(fake, replace(FAST, max_attempts=0), fake.probe)
    long = replace(request(), request_id="busy", sampling=replace(request().sampling, max_tokens=60))

    async def go():
        return await asyncio.gather(collect(streamer, replace(request(), request_id="waiting")),
                                    collect(streamer, long))

    waiting, busy = run(go())
    assert tokens(waiting) == reference() and tokens(busy) == reference(n=60)
    assert [r.request_id for r in fake.requests] == ["waiting", "busy"]  # nothing continued


def test_a_stopped_scheduler_is_given_up_on_after_one_round_of_unanswered_probes():
    """What a SIGSTOPped scheduler looks like: silent, and every probe unanswered. The round
    gives each probe backoff times longer, then the stream is continued."""
    fake = SlowHealthScheduler([("stall", 4)], latency_s=60.0, answers=False)
    chunks = run(collect(ContinuingStreamer(fake, FAST, fake.probe)))
    assert tokens(chunks) == reference() and len(fake.requests) == 2
    t = FAST.probe_timeout_s
    assert fake.probe_timeouts == [t, 2 * t, 4 * t]


def test_a_scheduler_the_transport_knows_is_unreachable_is_given_up_on_without_probing():
    fake = SlowHealthScheduler([("stall", 4)], latency_s=60.0, answers=False)
    # (a gRPC channel in TRANSIENT_FAILURE: the connection broke and reconnecting fails)
    streamer = ContinuingStreamer(fake, FAST, fake.probe, unreachable=lambda: True)
    chunks = run(collect(streamer))
    assert tokens(chunks) == reference() and len(fake.requests) == 2
    assert fake.probe_timeouts == []  # TRANSIENT_FAILURE is an answer: no probe was waited out


@pytest.mark.parametrize("field,value", [("probe_attempts", 0), ("probe_backoff", 0.5)])
def test_policy_rejects_a_probe_round_that_cannot_work(field, value):
    with pytest.raises(ValueError, match=field):
        ContinuationPolicy(**{field: value})


def test_the_scheduler_client_reports_a_dead_address_unreachable_and_a_live_one_not():
    """The router hands SchedulerClient.unreachable to the continuation's liveness check: a
    channel whose connect failed counts the scheduler dead without a probe round."""
    from services.mesh.nats_server import free_port

    async def run() -> tuple[bool, bool]:
        dead = SchedulerClient(f"127.0.0.1:{free_port()}")  # nothing listens there
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        live = SchedulerClient(f"127.0.0.1:{port}")
        try:
            assert not await dead.probe(0.5)  # the connect attempt fails
            assert await live.probe(5.0)
            for _ in range(100):  # the channel state settles right after the failed attempt
                if dead.unreachable():
                    break
                await asyncio.sleep(0.02)
            return dead.unreachable(), live.unreachable()
        finally:
            await dead.close()
            await live.close()
            await server.stop(None)

    dead_unreachable, live_unreachable = asyncio.run(run())
    assert dead_unreachable
    assert not live_unreachable
