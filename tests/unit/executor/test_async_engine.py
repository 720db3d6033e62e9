"""AsyncEngine: the engine thread driven from asyncio on a tiny random checkpoint.

Every wait is on a condition with a deadline (``asyncio.wait_for`` / a polling loop over
``ae.call``), so a bug shows up as a failure, never as a hung test run."""
from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from services.executor.engine.async_engine import AsyncEngine, EngineDeadError
from services.executor.engine.engine import LLMEngine
from services.executor.engine.config import EngineConfig
from services.executor.errors import InvalidRequestError
from services.executor.engine.sampling_params import SamplingParams
from weft import LLM
from weft.testing.tiny_model import make_tiny_checkpoint

DEADLINE_S = 20.0  # generous for a loaded 2-core machine; a healthy run takes < 1 s
ANSWER_S = 3.0  # for what the engine thread answers at once (refusals, dead-engine errors)
NUM_KV_BLOCKS = 64
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[(11 + 5 * i) % 1024 for i in range(23)], [(400 + 3 * i) % 1024 for i in range(7)]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), preset="tiny", arch="llama")


@pytest.fixture
def make_async_engine(checkpoint):
    started: list[AsyncEngine] = []

    def make(**kwargs) -> AsyncEngine:
        ae = AsyncEngine(LLMEngine(checkpoint, EngineConfig(num_kv_blocks=NUM_KV_BLOCKS)), **kwargs)
        started.append(ae)
        return ae

    yield make
    for ae in started:
        ae.shutdown(timeout_s=5.0)


async def _collect(ae: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    tokens: list[int] = []
    async for out in ae.generate(rid, prompt, params):
        tokens.extend(out.new_token_ids)
    return tokens


async def _wait_until_all_blocks_free(ae: AsyncEngine) -> int:
    """Poll the engine between steps until every block is free; the last count seen."""
    deadline = time.monotonic() + DEADLINE_S
    free = -1
    while time.monotonic() < deadline:
        free = await asyncio.wait_for(ae.call(lambda e: e.pool.num_free_blocks), DEADLINE_S)
        if free == NUM_KV_BLOCKS:
            break
    return free


def test_two_concurrent_tasks_get_the_same_tokens_as_llm_generate(checkpoint, make_async_engine):
    expected = [o.token_ids for o in LLM(checkpoint, num_kv_blocks=NUM_KV_BLOCKS).generate(PROMPTS, GREEDY)]
    ae = make_async_engine()

    async def main():
        # LLM.generate adds both prompts before its first step, and the batch's shape can
        # change the numbers: so both adds go in behind a parked engine thread, which applies
        # them together (it drains its inbox before stepping) and steps them as one batch.
        release = await _hold_engine_thread(ae)
        try:
            tasks = [asyncio.ensure_future(_collect(ae, f"r{i}", p, GREEDY)) for i, p in enumerate(PROMPTS)]
            await asyncio.sleep(0)  # one yield: each task runs up to awaiting its add's acceptance
            assert ae._inbox.qsize() == len(PROMPTS), "the adds are not all queued behind the parked thread"
        finally:
            release.set()
        return await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S)

    assert asyncio.run(main()) == expected


def test_breaking_out_of_the_stream_aborts_and_frees_the_blocks(make_async_engine):
    ae = make_async_engine()
    long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)

    async def main():
        got: list[int] = []
        async for out in ae.generate("r", PROMPTS[0], long):
            got.extend(out.new_token_ids)
            if len(got) >= 2:
                break
        free = await _wait_until_all_blocks_free(ae)
        unfinished = await ae.call(lambda e: e.has_unfinished_requests)
        return got, free, unfinished

    got, free, unfinished = asyncio.run(main())
    assert len(got) == 2
    assert free == NUM_KV_BLOCKS
    assert not unfinished and ae.num_active == 0


def test_invalid_request_raises_before_any_output_and_the_engine_serves_on(make_async_engine):
    ae = make_async_engine()

    async def main():
        outputs = []
        with pytest.raises(InvalidRequestError) as err:
            async for out in ae.generate("bad", [], GREEDY):
                outputs.append(out)
        assert outputs == []
        good = await asyncio.wait_for(_collect(ae, "good", PROMPTS[1], GREEDY), DEADLINE_S)
        return err.value.field, good

    field, good = asyncio.run(main())
    assert field == "prompt"
    assert len(good) == GREEDY.max_tokens


def test_a_malformed_prompt_is_refused_without_killing_the_engine_thread(make_async_engine):
    ae = make_async_engine()

    async def main():
        with pytest.raises(InvalidRequestError):
            # a token id the engine cannot even compare with the vocabulary size
            await asyncio.wait_for(_collect(ae, "bad", [5, "6"], GREEDY), ANSWER_S)
        return await asyncio.wait_for(_collect(ae, "good", PROMPTS[1], GREEDY), DEADLINE_S)

    assert len(asyncio.run(main())) == GREEDY.max_tokens


def test_shutdown_ends_streams_with_engine_dead_and_frees_their_blocks(make_async_engine):
    ae = make_async_engine()
    long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)

    async def main():
        stream = ae.generate("r", PROMPTS[0], long)
        first = await asyncio.wait_for(stream.__anext__(), DEADLINE_S)
        ae.shutdown(timeout_s=DEADLINE_S)
        with pytest.raises(EngineDeadError):
            while True:  # outputs already queued may arrive first; then the error
                await asyncio.wait_for(stream.__anext__(), DEADLINE_S)
        with pytest.raises(EngineDeadError):
            await _collect(ae, "late", PROMPTS[1], GREEDY)
        return first

    first = asyncio.run(main())
    assert len(first.new_token_ids) == 1
    # the thread is gone, so reading the engine directly is safe now
    assert ae.engine.pool.num_free_blocks == NUM_KV_BLOCKS
    assert not ae.engine.has_unfinished_requests


def test_calls_and_requests_pending_at_shutdown_fail_instead_of_hanging(make_async_engine):
    # Hold the engine thread inside a step's kv-event callback, queue a call and a new
    # request, shut down, then let the thread go: nothing queued may be left unanswered.
    in_callback, release = threading.Event(), threading.Event()

    def hold_first_batch(events):
        in_callback.set()
        release.wait(DEADLINE_S)

    ae = make_async_engine(on_kv_events=hold_first_batch)
    long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)

    async def main():
        running = asyncio.ensure_future(_collect(ae, "running", PROMPTS[0], long))  # 23 tokens: a full block
        assert await asyncio.to_thread(in_callback.wait, DEADLINE_S), "the first step never stored a block"
        pending_call = asyncio.ensure_future(ae.call(lambda e: e.pool.num_free_blocks))
        pending_add = asyncio.ensure_future(_collect(ae, "queued", PROMPTS[1], GREEDY))
        # One yield, not a timed wait: both tasks run up to their first await, which
        # comes after they have put their commands in the engine's inbox.
        await asyncio.sleep(0)
        ae.shutdown(timeout_s=0.01)  # the thread is held: this only flags and enqueues
        release.set()
        results = await asyncio.wait_for(
            asyncio.gather(running, pending_call, pending_add, return_exceptions=True), ANSWER_S
        )
        return results

    results = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) for r in results), results


def test_call_after_shutdown_raises_engine_dead_instead_of_hanging(make_async_engine):
    ae = make_async_engine()
    ae.shutdown(timeout_s=DEADLINE_S)

    async def main():
        await asyncio.wait_for(ae.call(lambda e: e.pool.num_free_blocks), ANSWER_S)

    with pytest.raises(EngineDeadError):
        asyncio.run(main())


# -- the engine thread survives whatever its callers and callbacks do (issue 12) --------
async def _hold_engine_thread(ae: AsyncEngine) -> threading.Event:
    """Park the engine thread inside a call until the returned event is set, so commands
    queued meanwhile are applied only afterwards (a deterministic 'add still in flight')."""
    parked, release = threading.Event(), threading.Event()

    def park(engine):
        parked.set()
        release.wait(DEADLINE_S)

    asyncio.ensure_future(ae.call(park))
    assert await asyncio.to_thread(parked.wait, DEADLINE_S), "the engine thread never ran the parking call"
    return release


async def _assert_serving_and_clean(ae: AsyncEngine) -> None:
    assert ae.is_alive, "the engine thread died"
    tokens = await asyncio.wait_for(_collect(ae, f"after-{time.monotonic_ns()}", PROMPTS[1], GREEDY), DEADLINE_S)
    assert len(tokens) == GREEDY.max_tokens
    assert await _wait_until_all_blocks_free(ae) == NUM_KV_BLOCKS
    assert not await ae.call(lambda e: e.has_unfinished_requests)
    assert ae.num_active == 0


def test_a_caller_cancelled_while_its_add_is_in_flight_leaves_the_engine_serving(make_async_engine):
    ae = make_async_engine()
    long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)

    async def main():
        for i in range(5):
            release = await _hold_engine_thread(ae)
            stream = asyncio.ensure_future(_collect(ae, f"gone-{i}", PROMPTS[0], long))
            await asyncio.sleep(0)  # one yield: the add is in the inbox, awaiting acceptance
            stream.cancel()
            with pytest.raises(asyncio.CancelledError):
                await stream
            release.set()  # now the thread applies the add whose caller is gone
            await _assert_serving_and_clean(ae)

    asyncio.run(main())


def test_many_callers_cancelled_at_random_points_leave_no_request_behind(make_async_engine):
    ae = make_async_engine()
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    rng = random.Random(12)

    async def main():
        streams = []
        for i in range(200):
            streams.append(asyncio.ensure_future(_collect(ae, f"storm-{i}", PROMPTS[i % 2], long)))
            for _ in range(rng.randrange(4)):
                await asyncio.sleep(0)  # cancel some before, some during, some after acceptance
            streams[rng.randrange(len(streams))].cancel()
        for s in streams:
            s.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        await _assert_serving_and_clean(ae)

    asyncio.run(main())


def test_a_failing_abort_does_not_kill_the_engine_thread(make_async_engine):
    ae = make_async_engine()
    real_abort = ae.engine.abort_request
    calls = []

    def abort_once_broken(rid):
        calls.append(rid)
        if len(calls) == 1:
            raise RuntimeError("injected abort failure")
        return real_abort(rid)

    ae.engine.abort_request = abort_once_broken

    async def main():
        ae.abort("nobody")
        await _assert_serving_and_clean(ae)

    asyncio.run(main())
    assert calls and calls[0] == "nobody"


def test_a_failing_kv_event_callback_does_not_kill_the_engine_thread(make_async_engine):
    def broken(events):
        raise RuntimeError("injected kv callback failure")

    ae = make_async_engine(on_kv_events=broken)

    async def main():
        tokens = await asyncio.wait_for(_collect(ae, "r", PROMPTS[0], GREEDY), DEADLINE_S)
        assert len(tokens) == GREEDY.max_tokens
        await _assert_serving_and_clean(ae)

    asyncio.run(main())


def test_outputs_for_a_closed_event_loop_abort_the_request_instead_of_killing_the_thread(make_async_engine):
    ae = make_async_engine()
    long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
    gone = asyncio.new_event_loop()
    stream = ae.generate("orphan", PROMPTS[0], long)
    try:
        gone.run_until_complete(asyncio.wait_for(stream.__anext__(), DEADLINE_S))
    finally:
        gone.close()  # the caller's loop is gone while its request still produces tokens

    async def main():
        await _assert_serving_and_clean(ae)

    asyncio.run(main())
    asyncio.run(stream.aclose())  # finish the orphaned generator (its finally only queues an abort)
