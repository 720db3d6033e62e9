"""Router-level continuation (services/router/continuation.py): a stream whose scheduler
dies, restarts or stalls mid-stream is re-issued from prompt + tokens so far, and the
client sees one stream: greedy output identical, usage across attempts, bounded attempts.

The fake schedulers are deterministic "greedy models": the next token is a function of
the whole context, so a continuation only reproduces the undisturbed run when its prompt
is exactly the original prompt + every token relayed."""
from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from services.mesh.grpc_server import ErrorMappingInterceptor, ErrorRule, error_origin_of
from services.router.continuation import ContinuationPolicy, ContinuingStreamer
from services.router.errors import InvalidRequestError, UpstreamUnavailable
from services.router.generation import Generator, model_limits
from services.router.scheduler_client import SchedulerClient
from services.router.schema import Sampling, Session, TokenChunk, TokenRequest
from services.shared.tokenizer import Tokenizer
from services.scheduler.errors import ExecutorLostError
from services.shared.stream_resume import continuation_seed
from services.shared.stream_watch import StallCheckFailed
from weft.testing.tiny_model import make_tiny_checkpoint
from weft.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

PROMPT = (11, 12, 13, 14)
MAX_TOKENS = 12
FAST = ContinuationPolicy(max_attempts=3, reconnect_wait_s=5.0, min_stall_s=0.2, first_chunk_probe_s=0.5,
                          probe_timeout_s=0.2)
SAFETY_S = 30.0  # every test's outer deadline: a hang fails, it never blocks the suite


def greedy_next(context) -> int:
    return (sum(context) * 31 + len(context)) % 97 + 3


def reference(prompt=PROMPT, n=MAX_TOKENS) -> list[int]:
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(greedy_next(ctx))
    return ctx[len(prompt):]


def request(**sampling) -> TokenRequest:
    return TokenRequest(request_id="r1", model="", prompt_token_ids=PROMPT, tenant="t",
                        sampling=Sampling(max_tokens=MAX_TOKENS, temperature=0.0, **sampling))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, SAFETY_S))


class ScriptedScheduler:
    """In-process downstream: each call streams greedy tokens one per chunk; ``script[i]``
    says how call i ends: ("lose", k) fails lost after k tokens, ("stall", k) goes silent
    after k tokens, ("refuse", exc) raises exc at once; missing: runs to the end."""

    def __init__(self, script=(), alive: bool = False) -> None:
        self.script = list(script)
        self.requests: list[TokenRequest] = []
        self.alive = alive  # what the health probe answers
        self.probed = asyncio.Event()

    async def probe(self, timeout_s: float) -> bool:
        self.probed.set()
        return self.alive

    async def generate(self, req: TokenRequest, timeout_s: float):
        self.requests.append(req)
        how, arg = self.script.pop(0) if self.script else ("run", None)
        if how == "refuse":
            raise arg
        ctx = list(req.prompt_token_ids)
        for i in range(req.sampling.max_tokens):
            if how in ("lose", "stall") and i == arg:
                if how == "lose":
                    raise UpstreamUnavailable("scheduler: UNAVAILABLE: Socket closed", lost=True)
                await asyncio.Event().wait()  # silent forever (cancelled by the stall watch)
            if how == "slow" and i == arg:
                await self.probed.wait()  # a live scheduler, silent until the router has probed it
            ctx.append(greedy_next(ctx))
            last = i + 1 == req.sampling.max_tokens
            yield TokenChunk((ctx[-1],), (), "length" if last else None, len(req.prompt_token_ids), 2, i + 1,
                             "executor-0", degradation_rung="none" if i == 0 else "", num_migrations=0)


async def collect(streamer, req=None) -> list[TokenChunk]:
    return [c async for c in streamer.generate(req or request(), 20.0)]


def tokens(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def test_a_lost_scheduler_mid_stream_is_continued_from_prompt_plus_tokens_sent():
    fake = ScriptedScheduler([("lose", 5)])
    chunks = run(collect(ContinuingStreamer(fake, FAST, fake.probe)))
    assert tokens(chunks) == reference()
    cont = fake.requests[1]
    assert cont.prompt_token_ids == PROMPT + tuple(reference()[:5])
    assert cont.sampling.max_tokens == MAX_TOKENS - 5 and cont.request_id == "r1.c1"
    last = chunks[-1]  # usage across attempts: the original prompt, every output token
    assert (last.finish_reason, last.num_prompt_tokens, last.num_output_tokens) == ("length", len(PROMPT), MAX_TOKENS)
    assert last.num_cached_tokens == 2 and last.num_migrations == 1
    assert [c.degradation_rung for c in chunks].count("none") == 1  # the rung is named once


def test_a_silent_scheduler_that_fails_its_health_probe_is_continued():
    fake = ScriptedScheduler([("stall", 4), ("lose", 3)])
    chunks = run(collect(ContinuingStreamer(fake, FAST, fake.probe)))
    assert tokens(chunks) == reference() and len(fake.requests) == 3
    assert fake.requests[2].prompt_token_ids == PROMPT + tuple(reference()[:7])
    assert chunks[-1].num_migrations == 2 and chunks[-1].num_output_tokens == MAX_TOKENS


def test_a_silent_scheduler_that_answers_its_health_probe_is_waited_on():
    fake = ScriptedScheduler([("slow", 3)], alive=True)
    chunks = run(collect(ContinuingStreamer(fake, FAST, fake.probe)))
    assert tokens(chunks) == reference() and len(fake.requests) == 1 and fake.probed.is_set()


def test_a_stall_check_that_raises_ends_the_stream_with_an_error_and_is_not_continued():
    """A liveness check that raises is a router bug: the stream ends (INTERNAL upstairs)
    rather than hanging unwatched or being continued on a verdict nobody gave."""
    fake = ScriptedScheduler([("stall", 3)])

    def unreachable() -> bool:
        raise RuntimeError("channel state unreadable")

    async def consume(streamer):
        sent = []
        with pytest.raises(StallCheckFailed) as info:
            async for c in streamer.generate(request(), 20.0):
                sent.append(c)
        return sent, info.value

    sent, error = run(consume(ContinuingStreamer(fake, FAST, fake.probe, unreachable)))
    assert tokens(sent) == reference()[:3] and len(fake.requests) == 1
    assert isinstance(error.__cause__, RuntimeError)


def test_continuations_are_bounded_and_the_error_names_the_tokens_sent():
    fake = ScriptedScheduler([("lose", 2), ("lose", 1), ("lose", 1)])
    policy = replace(FAST, max_attempts=2)
    with pytest.raises(UpstreamUnavailable, match="after 4 tokens were sent") as info:
        run(collect(ContinuingStreamer(fake, policy, fake.probe)))
    assert len(fake.requests) == 3 and not info.value.lost  # terminal: nothing above continues it again


def test_a_status_the_scheduler_chose_mid_stream_is_not_continued():
    class Chosen(ScriptedScheduler):
        async def generate(self, req, timeout_s):
            self.requests.append(req)
            yield TokenChunk((5,), (), None, 4, 0, 1, "e")
            raise UpstreamUnavailable("scheduler: UNAVAILABLE: stream lost after 3 executor(s) failed")

    fake = Chosen()
    with pytest.raises(UpstreamUnavailable, match="3 executor"):
        run(collect(ContinuingStreamer(fake, FAST, fake.probe)))
    assert len(fake.requests) == 1


def test_a_failure_before_the_first_chunk_is_left_to_the_scheduler_client():
    fake = ScriptedScheduler([("lose", 0)])
    with pytest.raises(UpstreamUnavailable):
        run(collect(ContinuingStreamer(fake, FAST, fake.probe)))
    assert len(fake.requests) == 1


def test_a_continuation_waits_out_a_refusing_scheduler_within_the_reconnect_window():
    busy = UpstreamUnavailable("scheduler: UNAVAILABLE: no serving executor")  # restarted, executors unknown yet
    fake = ScriptedScheduler([("lose", 5), ("refuse", busy), ("refuse", busy)])
    chunks = run(collect(ContinuingStreamer(fake, FAST, fake.probe)))
    assert tokens(chunks) == reference() and len(fake.requests) == 4
    assert chunks[-1].num_migrations == 1  # one continuation, three tries to open it


def test_a_stateful_hop_the_scheduler_no_longer_knows_ends_with_a_clear_error():
    unknown = InvalidRequestError("session.session_id", "unknown session 's1'")
    fake = ScriptedScheduler([("lose", 5), ("refuse", unknown)])
    req = replace(request(), session=Session(session_id="s1", hop_index=2, stateful=True))
    with pytest.raises(UpstreamUnavailable, match="after 5 tokens.*resend the hop with its full prompt"):
        run(collect(ContinuingStreamer(fake, FAST, fake.probe), req))
    cont = fake.requests[1]  # still stateful: new tokens + tokens sent; the scheduler prepends the context once
    assert cont.session.stateful and cont.session.hop_index == 2
    assert cont.prompt_token_ids == PROMPT + tuple(reference()[:5])


def test_a_seeded_continuation_is_seeded_from_seed_and_tokens_sent():
    fake = ScriptedScheduler([("lose", 5)])
    run(collect(ContinuingStreamer(fake, FAST, fake.probe), request(seed=42)))
    assert fake.requests[0].sampling.seed == 42
    assert fake.requests[1].sampling.seed == continuation_seed(42, 5)


def test_a_continuation_tells_the_executor_how_many_prompt_tokens_are_resumed_output():
    """The grammar (structured output) must continue over the relayed tokens, not restart:
    each continuation counts every token relayed so far, across continuations; prompt
    logprobs went out with the first attempt and are not asked again."""
    fake = ScriptedScheduler([("lose", 3), ("lose", 2)])
    req = request(grammar=("json_object", ""), prompt_logprobs=1)
    chunks = run(collect(ContinuingStreamer(fake, FAST, fake.probe), req))
    assert tokens(chunks) == reference()
    first, second, third = (r.sampling for r in fake.requests)
    assert (first.resumed_output_tokens, second.resumed_output_tokens, third.resumed_output_tokens) == (0, 3, 5)
    assert (first.prompt_logprobs, second.prompt_logprobs, third.prompt_logprobs) == (1, None, None)
    assert third.grammar == ("json_object", "")
    assert len(fake.requests[2].prompt_token_ids) - third.resumed_output_tokens == len(PROMPT)


def test_detokenizer_and_stop_strings_continue_across_the_continuation(tmp_path):
    make_tiny_checkpoint(tmp_path / "m")
    tokenizer = Tokenizer.from_dir(tmp_path / "m")
    ids = tokenizer.encode("Hello there, my good friend and more", add_special_tokens=False)

    class Text(ScriptedScheduler):
        async def generate(self, req, timeout_s):
            self.requests.append(req)
            start = len(req.prompt_token_ids) - len(PROMPT)
            for i, t in enumerate(ids[start:], start):
                if not self.script and i == 3:
                    self.script.append("done")
                    raise UpstreamUnavailable("scheduler: UNAVAILABLE: Socket closed", lost=True)
                yield TokenChunk((t,), (), "length" if i + 1 == len(ids) else None, 4, 0, i + 1, "e")

    async def go():
        fake = Text()
        gen = Generator(tokenizer, model_limits(tmp_path / "m", tokenizer, ["m"], 512),
                        ContinuingStreamer(fake, FAST, fake.probe))
        req = replace(request(), sampling=replace(request().sampling, max_tokens=len(ids)))
        deltas = [d async for d in gen.stream(req, stop=("good friend",))]
        return fake, deltas

    fake, deltas = run(go())
    assert len(fake.requests) == 2
    assert "".join(d.text for d in deltas) == "Hello there, my " and deltas[-1].finish_reason == "stop"


# -- over real gRPC: the scheduler's server dies mid-stream and comes back on its port --
class GreedyScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Streams greedy tokens; with ``hold_after`` it stops producing after that many
    tokens (the stream stays open, mid-flight, until the server dies)."""

    def __init__(self, hold_after: int | None = None) -> None:
        self.hold_after = hold_after
        self.requests: list[scheduler_pb2.ScheduleRequest] = []
        self.held = asyncio.Event()

    async def Generate(self, req, context):
        self.requests.append(req)
        ctx = list(req.prompt_token_ids)
        n = req.sampling.max_tokens
        for i in range(n):
            if i == self.hold_after:
                self.held.set()
                await asyncio.Event().wait()
            ctx.append(greedy_next(ctx))
            yield scheduler_pb2.ScheduleResponse(
                request_id=req.request_id, token_ids_delta=[ctx[-1]], executor="executor-0",
                finish_reason=common_pb2.FINISH_REASON_LENGTH if i + 1 == n else 0,
                usage=common_pb2.Usage(num_prompt_tokens=len(req.prompt_token_ids), num_output_tokens=i + 1))


async def start_scheduler(servicer, port: int = 0):
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


def test_scheduler_killed_mid_stream_and_restarted_the_client_sees_the_undisturbed_greedy_output():
    async def go():
        first = GreedyScheduler(hold_after=5)
        server, port = await start_scheduler(first)
        client = SchedulerClient(f"127.0.0.1:{port}")
        streamer = ContinuingStreamer(client, FAST, client.probe)
        got: list[int] = []
        second = GreedyScheduler()

        async def consume():
            async for chunk in streamer.generate(request(), 20.0):
                got.extend(chunk.token_ids)
            return chunk

        task = asyncio.ensure_future(consume())
        try:
            await first.held.wait()
            await server.stop(0)  # the scheduler dies with the stream mid-flight
            restarted, _ = await start_scheduler(second, port)  # and comes back on its port
            last = await task
            await restarted.stop(0)
        finally:
            await client.close()
        return got, last, second.requests

    got, last, continued = run(go())
    assert got == reference() and last.num_output_tokens == MAX_TOKENS and last.num_prompt_tokens == len(PROMPT)
    assert list(continued[0].prompt_token_ids) == list(PROMPT) + reference()[:5]
    assert continued[0].request_id == "r1.c1"


def test_scheduler_that_stays_down_ends_the_stream_unavailable_after_bounded_attempts():
    async def go():
        first = GreedyScheduler(hold_after=4)
        server, port = await start_scheduler(first)
        client = SchedulerClient(f"127.0.0.1:{port}")
        streamer = ContinuingStreamer(client, replace(FAST, reconnect_wait_s=0.5), client.probe)
        got: list[int] = []

        async def consume():
            async for chunk in streamer.generate(request(), 20.0):
                got.extend(chunk.token_ids)

        task = asyncio.ensure_future(consume())
        try:
            await first.held.wait()
            await server.stop(0)
            with pytest.raises(UpstreamUnavailable, match="after 4 tokens were sent") as info:
                await task
        finally:
            await client.close()
        return got, info.value

    got, err = run(go())
    assert got == reference()[:4] and not err.lost


def test_a_weft_server_marks_the_statuses_it_chose():
    class Failing(scheduler_pb2_grpc.SchedulerServicer):
        async def Generate(self, req, context):
            yield scheduler_pb2.ScheduleResponse(token_ids_delta=[1])
            raise ExecutorLostError("stream lost after 3 executor(s) failed")

    async def go():
        server = grpc.aio.server(interceptors=[ErrorMappingInterceptor(
            [ErrorRule(ExecutorLostError, grpc.StatusCode.UNAVAILABLE)])])
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(Failing(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in scheduler_pb2_grpc.SchedulerStub(ch).Generate(
                            scheduler_pb2.ScheduleRequest(request_id="x"), timeout=10):
                        pass
        finally:
            await server.stop(0)
        return info.value

    err = run(go())
    assert err.code() == grpc.StatusCode.UNAVAILABLE and error_origin_of(err) == "ExecutorLostError"
